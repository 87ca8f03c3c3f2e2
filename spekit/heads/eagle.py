"""EAGLE-1 head (Li et al. 2024): one decoder layer that runs autoregressively on the target's features.

Entry t of the head reads the embedding of token t+1 and the target's feature at t (the last hidden state, after
the final norm, as `FeatureBatch` numbers it), fused by `fc`, and through one Llama decoder layer (transformers'
own `LlamaDecoderLayer`, with the target's dimensions, without input norm as in the paper's code) predicts the feature at t+1; the target's shared LM head
turns that prediction into the distribution of token t+2. Drafting deeper, the head feeds on its own predictions.

The loss is the paper's: smooth-L1 regression of the next feature plus the cross-entropy of the head's token
distribution against the target's (soft labels), both over the positions the batch marks.

`unroll` is shared with EAGLE-3: it runs the head `steps` times over a whole sequence, step j reading its own
outputs of step j-1 (training-time test), with the attention mask the drafted tree would give (committed context
causally, the earlier steps of the same row diagonally) and positions shifted by j.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..config import UserError
from .base import DraftVocab, FeatureBatch, Head, check_numbers, register_head, target_info


@dataclass(frozen=True)
class LayerShape:
    """The decoder layer's dimensions (the target's, unless told otherwise)."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: str = ""       # JSON of the layer's rope_parameters besides rope_theta (e.g. Llama 3's "llama3"
                                 # scaling, as an imported checkpoint names it); "" = plain RoPE


def target_shape(target) -> dict:
    """The target's layer dimensions as Config fields (target: spekit.backends.torch_target.Target)."""
    c = target.config
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    return dict(hidden_size=int(c.hidden_size), intermediate_size=int(c.intermediate_size),
                num_attention_heads=int(c.num_attention_heads),
                num_key_value_heads=int(getattr(c, "num_key_value_heads", c.num_attention_heads)),
                head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads),
                rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_theta=float(theta),
                max_position_embeddings=int(getattr(c, "max_position_embeddings", 4096)))


def llama_config(cfg, vocab_size: int):
    from transformers import LlamaConfig
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=1, num_attention_heads=cfg.num_attention_heads,
                         num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                         rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
                         rope_parameters=rope_parameters(cfg))
    config._attn_implementation = "sdpa"
    return config


def rope_parameters(cfg: LayerShape) -> dict:
    """The layer's rope_parameters for transformers: plain RoPE at rope_theta, or the scaling a checkpoint named."""
    scaling = json.loads(cfg.rope_scaling) if cfg.rope_scaling else {}
    if not isinstance(scaling, dict):
        raise UserError(f"rope_scaling must be a JSON object, got {cfg.rope_scaling!r}")
    return {"rope_type": "default", **scaling, "rope_theta": cfg.rope_theta}


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, N, S] -> additive float mask [B, 1, N, S]."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def unroll_masks(length: int, steps: int, device) -> list[torch.Tensor]:
    """For each training-time-test step j, which of the (j+1)*length keys row i may see: [length, (j+1)*length]
    bool (step 0 causally, steps 1..j only row i itself)."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return [torch.cat([causal] + [eye] * j, dim=1) for j in range(steps)]


def soft_ce(logits: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits [B, M, V] against target probabilities [B, M, V] over mask [B, M]."""
    loss = -(probs * logits.float().log_softmax(-1)).sum(-1)
    return (loss * mask).sum() / mask.sum().clamp(min=1)


def top1(logits: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor) -> float:
    hit = (logits.argmax(-1) == probs.argmax(-1)) & mask
    return float(hit.sum()) / max(1, int(mask.sum()))


class EagleBase(Head):
    """What the EAGLE proposers draft with. Subclasses build `layer`, `rotary` and implement `features`,
    `project`, `decode` and `draft_logits`."""

    draft_ids: torch.Tensor | None = None     # [Vd] target ids of the draft vocabulary; None = the target's own

    def borrowed_weights(self, target) -> int:
        """Weights of the target's that one draft level reads besides the head's own (none: it has its LM head)."""
        return 0

    def features(self, hidden) -> torch.Tensor:
        """The target features this head reads, from hidden states indexed like FeatureBatch.hidden (a tuple of
        every layer, or a dict of some): [B, L, F]."""
        return torch.cat([hidden[i] for i in self.feature_layers()], dim=-1)

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [B, N, F] -> the head's input space [B, N, H]."""
        return feats

    def step(self, emb: torch.Tensor, inp: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             cache) -> torch.Tensor:
        """One forward of the head over N entries: emb [B, N, H] token embeddings, inp [B, N, H] projected
        features (or the head's own earlier outputs), positions [B, N], mask [B, 1, N, S+N] additive over the
        cache's S slots and the new ones. Returns the head's output hidden states [B, N, H]."""
        rope = self.rotary(inp, positions.clamp(min=0))
        return self.decode(emb, inp, positions.clamp(min=0), mask, cache, rope)

    def unroll(self, batch: FeatureBatch, target, steps: int):
        """Run the head `steps` times over each whole sequence (see the module docstring). Yields
        (j, out [B, M, H], valid [B, M]) with M = L - 1; row i of step j predicts token i + j + 2."""
        tokens, mask = batch.tokens, batch.loss_mask
        b, length = tokens.shape
        m = length - 1
        embed = target.model.get_input_embeddings()
        inp = self.project(self.features(batch.hidden)[:, :m].to(self.dtype))
        from transformers import DynamicCache
        cache = DynamicCache()
        masks = unroll_masks(m, steps, tokens.device)
        rows = torch.arange(m, device=tokens.device)
        for j in range(steps):
            idx = (rows + 1 + j).clamp(max=length - 1)
            with torch.no_grad():
                emb = embed(tokens[:, idx]).to(self.dtype)
            valid = mask[:, (rows + j).clamp(max=length - 1)] & (rows + j < m)[None]
            am = additive(masks[j][None].expand(b, -1, -1), self.dtype)
            out = self.step(emb, inp, (rows + j)[None].expand(b, -1), am, cache)
            yield j, out, valid
            inp = out

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


@dataclass(frozen=True)
class EagleConfig(LayerShape):
    token_weight: float = 0.5        # weight of the token cross-entropy beside the feature regression
    feature_noise: float = 0.05      # uniform noise (x feature std) on the input features while training
    draft_vocab: int = 0             # draft over the rows of the target's LM head for this many tokens; 0 = all
    fc_bias: bool = False            # `fc` has a bias (the EAGLE repository's EAGLE-1 checkpoints have one)

    def __post_init__(self) -> None:
        check_numbers(self, 0, "token_weight", "feature_noise")
        if self.draft_vocab < 0:
            raise UserError(f"draft_vocab must be >= 0 (0 = the target's whole vocabulary), got {self.draft_vocab}")


@register_head
class EagleHead(DraftVocab, EagleBase):
    """`draft_vocab` > 0 keeps, when drafting, only the rows of the target's LM head for that many tokens (`token_map`
    [Vd], the most frequent answer tokens of the training data, set by `choose_vocab`), as MTP modules and
    EAGLE-3 do: on SmolLM2-135M the full head is 28M of a draft level's ~32M weights, and with 8192 rows a level
    reads a fifteenth of a target forward instead of a quarter. Training still fits the whole distribution, so a
    trained head takes a draft vocabulary afterwards (`reconfigured`); the exact verification is unchanged for any
    draft distribution (spekit.backends.draft_vocab). Not part of the engines' EAGLE layout: an export leaves it out."""

    kind = "eagle"
    Config = EagleConfig
    reconfigurable = frozenset({"draft_vocab"})      # inference only: no trained weight depends on it

    def __init__(self, config: EagleConfig, target_config: dict):
        super().__init__(config, target_config)
        h, vocab = config.hidden_size, int(target_config["vocab_size"])
        if config.draft_vocab > vocab:
            raise UserError(f"draft_vocab {config.draft_vocab} is larger than the target's vocabulary ({vocab})")
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
        lc = llama_config(config, vocab)
        self.fc = torch.nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layer = LlamaDecoderLayer(lc, layer_idx=0)
        self.layer.input_layernorm = torch.nn.Identity()     # EAGLE-1 has none (vLLM and SGLang drop it too)
        self.rotary = LlamaRotaryEmbedding(lc)
        self.add_token_map()
        self._rows: tuple | None = None      # (what they were cut from, the LM head's rows for token_map, bias)

    @classmethod
    def create(cls, target, **options) -> "EagleHead":
        return cls(cls.Config(**{**target_shape(target), **options}), target_info(target))

    def feature_layers(self) -> list[int]:
        return [int(self.target_config["num_layers"])]

    def decode(self, emb, inp, positions, mask, cache, rope) -> torch.Tensor:
        x = self.fc(torch.cat([emb, inp], dim=-1))
        return self.layer(x, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                          position_embeddings=rope)

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """[Vd] target id of each draft token, or None: the target's whole vocabulary."""
        return self.token_map if self.config.draft_vocab else None

    def choose_vocab(self, token_counts: torch.Tensor) -> None:
        super().choose_vocab(token_counts)
        self._rows = None                    # the LM head's rows are cut again for the new ids

    def borrowed_weights(self, target) -> int:
        """Weights of the target's a draft level reads besides the head's own: its LM head's rows drafted over."""
        lm = target.model.get_output_embeddings().weight
        return lm.numel() if self.draft_ids is None else len(self.token_map) * lm.shape[1]

    def draft_logits(self, out: torch.Tensor, target) -> torch.Tensor:
        """[B, N, H] -> [B, N, Vd] (the draft vocabulary's ids: `draft_ids`; [B, N, V] without one) through the
        target's LM head (the head predicts the target's feature)."""
        lm = target.model.get_output_embeddings()
        if self.draft_ids is None:
            return lm(out.to(lm.weight.dtype))
        key = (lm.weight.data_ptr(), lm.weight.dtype, self.token_map.data_ptr())
        if self._rows is None or self._rows[0] != key:                # cut once, not at every level
            bias = None if lm.bias is None else lm.bias.detach()[self.token_map]
            self._rows = (key, lm.weight.detach()[self.token_map], bias)
        _, rows, bias = self._rows
        return torch.nn.functional.linear(out.to(rows.dtype), rows, bias)                  # [B, N, Vd]

    def full_logits(self, out: torch.Tensor, target) -> torch.Tensor:
        """[B, N, H] -> [B, N, V] over the whole vocabulary (training fits the whole distribution)."""
        lm = target.model.get_output_embeddings()
        return lm(out.to(lm.weight.dtype))

    def training_loss(self, batch: FeatureBatch, target) -> tuple[torch.Tensor, dict[str, float]]:
        last = self.feature_layers()[0]
        if last not in batch.hidden:
            raise UserError(f"the batch lacks hidden layer {last}, which an eagle head trains on")
        feats = batch.hidden[last]
        if self.training and self.config.feature_noise > 0:
            noise = (torch.rand_like(feats) - 0.5) * (2 * self.config.feature_noise * feats.std())
            batch = FeatureBatch(batch.tokens, batch.loss_mask, {last: feats + noise})
        _, out, valid = next(self.unroll(batch, target, 1))
        want = feats[:, 1:].to(out.dtype)                                     # [B, M, H] the next features
        lm = target.model.get_output_embeddings()
        with torch.no_grad():
            probs = lm(want.to(lm.weight.dtype)).float().softmax(-1)          # [B, M, V]
        logits = self.full_logits(out, target)
        fmask = valid[..., None].to(out.dtype)
        reg = (torch.nn.functional.smooth_l1_loss(out, want, reduction="none") * fmask).sum() / (
            fmask.sum().clamp(min=1) * out.shape[-1])
        ce = soft_ce(logits, probs, valid)
        loss = reg + self.config.token_weight * ce
        return loss, {"loss": float(loss.detach()), "reg": float(reg.detach()), "ce": float(ce.detach()), "top1": top1(logits, probs, valid)}
