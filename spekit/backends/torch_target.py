"""The target adapter over any Hugging Face causal LM: prefill, then one forward over a draft tree with a 4-D
mask and explicit position ids, logits at every node, hidden states on request. No modeling code is copied."""
from __future__ import annotations

import contextlib
import functools
import time

import torch

from ..pacing import profiles
from ..config import UserError, check_transformers
from ..cache import BufferPool, KVState, Window
from ..pacing.priors import prior_for
from ..pacing.step_costs import StepCosts
from .fast_forward import use_fast_linear, use_gqa_attention
from .cuda_graphs import StaticStep, hidden_request
from .row_invariant import STORE_DTYPE, bulk, use_invariant_forms
from .torch_models import cache_root, dtype_name
from .weight_quant import PackedLinear, packed_bits


# the layer kinds whose state is a KV cache that spekit rolls back to the accepted tokens (windows in the mask)
ATTENTION_LAYERS = ("full_attention", "sliding_attention")


def check_layers(model: torch.nn.Module) -> None:
    """Refuse a model with layers whose state a rejected draft would leave advanced (recurrent, convolutional,
    linear attention: Mamba, Jamba, LFM2, Qwen3-Next), or whose attention pattern the mask does not draw (Llama 4's
    chunked attention)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    other = sorted({kind for kind in getattr(config, "layer_types", None) or [] if kind not in ATTENTION_LAYERS})
    if other:
        raise UserError(f"'{getattr(config, 'model_type', '?')}' has {', '.join(other)} layers: spekit verifies "
                        "drafts by rolling its KV cache back to the accepted tokens, which those layers' state "
                        "(or attention pattern) does not allow; models whose layers are all full or sliding-window "
                        "attention are supported")


@functools.cache
def selects_hidden() -> bool:
    """Whether this transformers takes `output_hidden_states` as a list of indices (and keeps only those)."""
    try:
        from transformers.utils.output_capturing import selected_hidden_states  # noqa: F401
    except ImportError:
        return False
    return True


class Target:
    chains_only = False        # verifies whole draft trees (and side nodes) in one forward
    backend = "torch"

    def __init__(self, model: torch.nn.Module, fast: bool = True, compile: bool = False, cuda_graphs: bool = True,
                 static: bool = False, cost_profile: str = "none", exact: bool = True):
        """fast: switch a float32 model to the faster CPU forms of `fastpath` (in place; same results to rounding).
        A bfloat16, float16 or quantized CPU model always gets the row-invariant forms of `invariant` instead
        (verification rows then equal plain steps bit for bit).
        compile: run the forward through torch.compile with dynamic shapes: the number of new tokens, the cache
        length and the batch are symbolic, so at most a handful of graphs (one new token or several, one row or
        several, with hidden states or without) cover every method's drafts and trees.
        cuda_graphs: on CUDA (without compile), decoding and verification steps of up to 64 new tokens per row are
        replayed as CUDA graphs (spekit.backends.cuda_graphs). static: the same static form without capture, on any device
        (tests). cost_profile: where the measured step costs (`self.costs`, shared by every engine over this
        target) are kept between runs: "auto", "none" or a file (spekit.pacing.profiles). exact=False leaves a low-precision
        CPU model its own kernels (no row-invariant forms): faster (1.3-1.6x for 32-64 rows of SmolLM2 in bfloat16), but
        verification rows may then round otherwise than plain steps, so only for plain decoding whose tokens need
        not match a verified run's (distilling training answers)."""
        check_transformers()
        check_layers(model)
        self.model = model.eval()
        self.invariant = exact and use_invariant_forms(model)
        if not self.invariant and fast:
            use_fast_linear(model)
            use_gqa_attention(model)
        self.compiled = compile
        self._forward = torch.compile(model.forward, dynamic=True) if compile else model.forward
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        self.vocab_size = int(model.get_output_embeddings().out_features)
        self.max_positions = int(getattr(config, "max_position_embeddings", 1 << 30) or (1 << 30))
        self.sliding_window = Window.of(config)
        self.num_layers = int(config.num_hidden_layers)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        capture = cuda_graphs and self.device.type == "cuda" and not compile and not self.invariant
        self.static = StaticStep(model.forward, capture) if capture or static else None
        self.captures = capture          # a new shape's first step records a CUDA graph (not a cost to time)
        # caches' buffers, reused so that graphs replay (and in the static form without capture, which tests it)
        self.pool = BufferPool() if self.static is not None else None
        bits = packed_bits(model)
        # seconds per step by batch, width and context
        self.costs = StepCosts(prior=prior_for(self.dtype, bool(bits), self.device.type))
        self.shared: dict | None = None  # prefills kept for reuse (sharing_prefills), key -> (cache, logits, ...)
        self.credit = 0.0                # seconds of prefills served from `shared`, less what serving them took
        key = profiles.fingerprint(model=type(model).__name__, config=model.config.to_dict(),
                                   dtype=dtype_name(self.dtype), packed_bits=bits, device=self.device,
                                   invariant=self.invariant, compiled=compile, captures=capture)
        profiles.attach(self.costs, key, cost_profile, cache_root())

    def weights_read(self) -> float:
        """Multiply-adds per token of the model's matrix products (its linear layers, packed or not, and LM head):
        what one decoding forward reads from memory, a draft model's cost relative to its target's."""
        return float(sum(m.in_features * m.out_features for m in self.model.modules()
                         if isinstance(m, (torch.nn.Linear, PackedLinear))))

    def new_state(self, batch: int) -> KVState:
        """A cache for `batch` rows, of SlotLayers (see cache.reserve)."""
        return KVState(batch, self.device, self.dtype, self.sliding_window, num_layers=self.num_layers,
                       store_dtype=STORE_DTYPE if self.invariant else None, pool=self.pool)

    @torch.inference_mode()
    def forward(self, kv: KVState, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                hidden: bool | tuple[int, ...] = False, last_only: bool = False):
        """One forward over N new tokens per row, appended to the cache.

        tokens: [B, N] long; positions: [B, N] long (-1 marks a padding token: it gets no slot anyone sees);
        tree_mask: [B, N, N] bool (new token i may attend new token j). Returns logits [B, N, V] ([B, 1, V] with
        last_only) and, with hidden, the tuple of hidden states per layer (embeddings first), each [B, N, H];
        hidden as a tuple of indices into that tuple keeps only those (the others are None)."""
        assert tokens.shape == positions.shape and tree_mask.shape == tokens.shape + tokens.shape[-1:]
        if isinstance(hidden, tuple) and not selects_hidden():
            hidden = True
        if self.static is not None:
            out = self.static(kv, tokens, positions, tree_mask, hidden)
            if out is not None:
                logits, states = out
                return (logits[:, -1:] if last_only else logits), states
        mask = kv.attention_mask(positions, tree_mask)
        if self.compiled and not tokens.is_inference():
            tokens = tokens.clone()        # one kind of input tensor: a graph is specialised on it (dispatch keys)
        out = self._forward(input_ids=tokens, position_ids=positions.clamp(min=0), attention_mask=mask,
                         cache=kv.cache, use_cache=True, output_hidden_states=hidden_request(hidden),
                         logits_to_keep=1 if last_only else 0)
        kv.appended(positions)
        return out.logits, (out.hidden_states if hidden else None)

    def prefilled(self, prompts: list[list[int]], slots: int, hidden: bool = False):
        """A new cache for these prompts with room for `slots` more tokens each, prefilled. Returns (cache, logits at
        each prompt's last token [B, V], hidden states or None). Within `sharing_prefills` an identical prefill
        is computed once, with hidden states (the same forward; keeping its layers' outputs costs nothing), for
        every method: later calls get a copy of its cache, and `credit` gains what it took."""
        key = (tuple(map(tuple, prompts)), slots)
        if self.shared is not None and key in self.shared:
            start = time.perf_counter()
            kv, logits, states, seconds = self.shared[key]
            kv = kv.copied()
            self.credit += max(0.0, seconds - (time.perf_counter() - start))
            return kv, logits, (states if hidden else None)
        start = time.perf_counter()
        kv = self.new_state(len(prompts))
        kv.reserve(self.capacity_for(max(len(p) for p in prompts) + slots))          # one allocation
        logits, states = self.prefill(kv, prompts, hidden=hidden or self.shared is not None)
        if self.shared is not None:
            logits[:, :1].tolist()                                   # wait for the device before timing
            self.shared[key] = (kv.copied(), logits, states, time.perf_counter() - start)
        return kv, logits, (states if hidden else None)

    def capacity_for(self, slots: int) -> int:
        """Slots to reserve for a cache that needs `slots`: as many, or where steps replay CUDA graphs (each one
        recorded for one capacity) rounded up to 256 times a power of two (up to 4096, then to a multiple of 4096),
        so that prompts of different lengths share the graphs recorded for one of them (also in the static form
        without capture, which tests it). Attention over the extra slots, masked, costs little on a GPU."""
        if self.static is None:
            return slots
        if slots > 4096:
            return -(-slots // 4096) * 4096
        return next(c for c in (256, 512, 1024, 2048, 4096) if slots <= c)

    @contextlib.contextmanager
    def sharing_prefills(self):
        """Within: identical prefills are computed once (see `prefilled`). For runs that answer the same prompts
        side by side (`spekit bench --lockstep`): the prefill is the same computation for every method, and run
        once it costs each the same; run by each in turn, the later ones would pay for the earlier ones' caches
        still alive. One prefill serves the methods that need hidden states too, so that they are not charged for a
        second prefill of their own."""
        before, self.shared = self.shared, {}
        try:
            yield
        finally:
            self.shared = before

    def take_credit(self) -> float:
        """Seconds credited by shared prefills since the last call (see `prefilled`)."""
        credit, self.credit = self.credit, 0.0
        return credit

    def score(self, prompt: list[int]) -> torch.Tensor:
        """Logits at every position of one prompt [L, V] (the prefill's forward, in a cache of its own that is
        dropped after): what the model gives each next token of a text it reads (echoed prompts' logprobs)."""
        kv = self.new_state(1)
        kv.reserve(len(prompt))
        return self.prefill(kv, [prompt], all_logits=True)[0][0]

    def prefill(self, kv: KVState, prompts: list[list[int]], hidden: bool = False, all_logits: bool = False):
        """Left-padded prefill of the prompts. Returns the logits at each prompt's last token [B, V] ([B, L, V] at
        every position with all_logits) and hidden states of every prompt position when asked."""
        batch, longest = len(prompts), max(len(p) for p in prompts)
        tokens = torch.zeros(batch, longest, dtype=torch.long)
        positions = torch.full((batch, longest), -1, dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens[b, longest - len(p):] = torch.tensor(p)
            positions[b, longest - len(p):] = torch.arange(len(p))
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        causal = torch.ones(longest, longest, dtype=torch.bool, device=self.device).tril()
        tree_mask = causal[None] & (positions >= 0)[:, None, :]
        tree_mask = tree_mask | torch.eye(longest, dtype=torch.bool, device=self.device)[None]
        # only the last position's logits are used: over a long prompt the full LM head would cost more than the
        # rest of the prefill (hidden states, when asked, do not need it)
        with bulk([longest - len(p) for p in prompts]):
            logits, states = self.forward(kv, tokens, positions, tree_mask, hidden=hidden, last_only=not all_logits)
        return (logits if all_logits else logits[:, -1]), states
