"""MTP modules (DeepSeek-V3 multi-token prediction) as a trainable head, and the loader of the modules a checkpoint
already carries.

Module k (0-based) is transformers' own `MtpLayer`: h' = post_norm(block(eh_proj(cat(enorm(emb(t)), hnorm(h))))),
where the block is one decoder layer of the target's own class, `post_norm` is DeepSeek's `shared_head.norm`, and
the embedding and LM head are the target's, passed in at call time (never stored). At position i, module 0 takes
the target's hidden state h_i and the token t_{i+1} and predicts t_{i+2}; module k takes module k-1's output at i
and t_{i+k+1} and predicts t_{i+k+2}; a chain of D modules drafts D tokens.

The hidden state fed to module 0 is the target's LAST `hidden_states` entry, i.e. after the final norm (FeatureBatch
index num_layers): transformers' own MTPCandidateGenerator feeds `hidden_states[-1]`, which is after the final norm
(checked on DeepSeek-V3), and spekit follows it for native and trained modules alike, so an exported module drafts
the same under transformers. Every module's output passes its `post_norm` before the LM head and the next module.

`draft_vocab` > 0 (trained modules only; not part of the DeepSeek-V3 layout, so an export leaves it out) keeps the
rows of the shared LM head for that many target tokens when drafting: `token_map` [Vd] holds their ids, the most
frequent answer tokens of the training data. On SmolLM2-135M the full head (49152 x 576) is 28M of a module step's
~31M weights, so a module step costs a quarter of a target forward with it and a twentieth with 8192 rows: the
difference between modules that never pay and modules that do. Training still fits the whole distribution;
verification is exact for any draft distribution (see spekit.backends.draft_vocab).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import UserError
from .base import DraftVocab, FeatureBatch, Head, register_head, target_info


@dataclass(frozen=True)
class MtpConfig:
    num_modules: int = 2
    intermediate_size: int = 0     # MLP width of each module's block; 0 = the target's (the DeepSeek-V3 layout)
    draft_vocab: int = 0           # tokens the modules draft from; 0 = the target's whole vocabulary

    def __post_init__(self) -> None:
        if not 1 <= self.num_modules <= 16:
            raise UserError(f"num_modules must be in 1..16, got {self.num_modules}")
        if self.intermediate_size < 0:
            raise UserError(f"intermediate_size must be >= 0, got {self.intermediate_size}")
        if self.draft_vocab < 0:
            raise UserError(f"draft_vocab must be >= 0, got {self.draft_vocab}")


def text_config(model) -> object:
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def module_config(arch: dict, num_modules: int, intermediate_size: int = 0):
    """The config the modules are built from: the target's text config with index-based fields made to fit D
    layers (transformers' get_mtp_config), and the MLP width overridden when asked."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if arch.get("model_type") not in CONFIG_MAPPING:
        raise UserError(f"MTP modules for an unknown architecture {arch.get('model_type')!r}")
    cfg = CONFIG_MAPPING[arch["model_type"]].from_dict(dict(arch))
    cfg.num_mtp_layers = num_modules
    if getattr(cfg, "layer_types", None) is not None and getattr(cfg, "mtp_layer_types", None) is None:
        cfg.mtp_layer_types = ["full_attention"] * num_modules
    if getattr(cfg, "mlp_layer_types", None) is not None and getattr(cfg, "mtp_mlp_layer_types", None) is None:
        cfg.mtp_mlp_layer_types = [cfg.mlp_layer_types[-1]] * num_modules
    out = cfg.get_mtp_config()
    if not hasattr(out, "rms_norm_eps"):         # transformers' MtpLayer reads it; LayerNorm families name it so
        out.rms_norm_eps = getattr(out, "norm_epsilon", None) or getattr(out, "layer_norm_eps", None) or 1e-5
    model_cls = AutoModelForCausalLM._model_mapping.get(type(cfg), None)
    out._attn_implementation = "sdpa" if getattr(model_cls, "_supports_sdpa", True) else "eager"   # Gemma 2: eager
    out._experts_implementation = "eager"        # a module of its own: transformers' dispatch never set these
    if intermediate_size:
        out.intermediate_size = intermediate_size
    return out


def layer_classes(cfg) -> tuple[type, type]:
    """(decoder layer class, norm class) of an architecture, from a model built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM
    small = copy.deepcopy(cfg)
    with torch.device("meta"):
        decoder = AutoModelForCausalLM.from_config(small).get_decoder()
    if not (hasattr(decoder, "layers") and hasattr(decoder, "norm")):
        raise UserError(f"MTP modules are built from a decoder with `layers` and `norm`; "
                        f"{cfg.model_type!r} names them otherwise")
    return type(decoder.layers[-1]), type(decoder.norm)


@register_head
class MtpHead(DraftVocab, Head):
    kind = "mtp"
    Config = MtpConfig
    reconfigurable = frozenset({"draft_vocab"})      # inference only: training fits the whole distribution

    def __init__(self, config: MtpConfig, target_config: dict):
        """target_config: target_info(target) plus "arch", the target's text config (to_dict), from which the
        modules' decoder layers are built."""
        from transformers.modeling_layers import MtpLayer   # (in every transformers spekit takes: 5.24 and up)
        super().__init__(config, target_config)
        if not target_config.get("arch"):
            raise UserError("an MTP head needs the target's architecture (target.arch in its config.json)")
        vocab = int(target_config["vocab_size"])
        if config.draft_vocab > vocab:
            raise UserError(f"draft_vocab {config.draft_vocab} is larger than the target's vocabulary ({vocab})")
        cfg = module_config(target_config["arch"], config.num_modules, config.intermediate_size)
        block_cls, norm_cls = layer_classes(cfg)
        self.layers = torch.nn.ModuleList(
            [MtpLayer(cfg, block_cls, norm_cls, k, use_post_norm=True) for k in range(config.num_modules)])
        self.add_token_map()

    @classmethod
    def create(cls, target, num_modules: int = 2, intermediate_size: int = 0, draft_vocab: int = 0, *,
               init_from_target: bool = True) -> "MtpHead":
        """Fresh modules for this target; init_from_target starts each block from the target's last decoder layer
        (sliced where the module's MLP is narrower), the norms from its final norm and eh_proj near [0, I] (mostly
        the hidden state passed on)."""
        info = {**target_info(target), "arch": text_config(target.model).to_dict()}
        head = cls(MtpConfig(num_modules, intermediate_size, draft_vocab), info)
        head.to(dtype=target.dtype, device=target.device)
        init = getattr(target.model, "_init_weights", None)     # the model's own init (fused MoE experts start empty)
        if init is not None:
            with torch.no_grad():
                head.apply(init)
        if init_from_target:
            head._init_from(target)
        return head

    @torch.no_grad()
    def _init_from(self, target) -> None:
        decoder = target.model.get_decoder()
        last = decoder.layers[-1].state_dict()
        hidden = self.layers[0].eh_proj.weight.shape[0]
        for layer in self.layers:
            for name, own in layer.mtp_block.state_dict().items():
                src = last.get(name)
                if src is not None and src.dim() == own.dim() and all(a <= b for a, b in zip(own.shape, src.shape)):
                    own.copy_(src[tuple(slice(0, n) for n in own.shape)])    # a narrower MLP takes a slice
            for norm in (layer.enorm, layer.hnorm, layer.post_norm):
                norm.load_state_dict(decoder.norm.state_dict())
            eye = torch.eye(hidden, dtype=layer.eh_proj.weight.dtype, device=layer.eh_proj.weight.device)
            layer.eh_proj.weight.copy_(torch.cat([0.1 * eye, eye], dim=1))

    def acceptance_options(self) -> dict:
        """`--method mtp` options that draft with every module at every step, whatever it costs: the modules'
        acceptance, for the tau recorded at training and compared by `spekit check`."""
        return {"min_draft_tokens": self.config.num_modules}

    def feature_layers(self) -> list[int]:
        return [int(self.target_config["num_layers"])]

    def step(self, k: int, target, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """Module k over W positions per row. tokens [B, W] (the token after each position's own, shifted by k+1),
        hidden [B, W, H] (the target's hidden state for k = 0, else module k-1's output), positions [B, W] (-1 =
        padding), mask: additive [B, 1, W, S+W] or None (causal). Returns module k's output [B, W, H]."""
        with torch.no_grad():                               # the target's weights stay frozen
            emb = target.model.get_input_embeddings()(tokens)
        pos = positions.clamp(min=0)
        rope = target.model.get_decoder().rotary_emb(emb, position_ids=pos)
        if mask is None:
            mask = _causal(positions, emb.dtype)
        return self.layers[k](emb, hidden.to(emb.dtype), position_embeddings=rope, attention_mask=mask,
                              position_ids=pos, cache=cache, use_cache=cache is not None)

    def logits(self, target, out: torch.Tensor) -> torch.Tensor:
        """[..., H] module output -> [..., V] logits through the target's LM head (frozen when training)."""
        lm_head = target.model.get_output_embeddings()
        if not torch.is_grad_enabled():
            return lm_head(out)
        bias = None if lm_head.bias is None else lm_head.bias.detach()
        return F.linear(out, lm_head.weight.detach(), bias)

    def chain(self, target, tokens: torch.Tensor, hidden: torch.Tensor):
        """Teacher-forced outputs of every module along whole sequences: tokens [B, L], hidden [B, L, H] (the
        target's last hidden state). Yields (k, out_k [B, L-k-1, H]): module k at position i predicts t_{i+k+2}."""
        length = tokens.shape[1]
        h = hidden
        for k in range(len(self.layers)):
            n = length - k - 1
            if n < 2:
                return
            positions = torch.arange(n, device=tokens.device).expand(tokens.shape[0], n)
            h = self.step(k, target, tokens[:, k + 1:k + 1 + n], h[:, :n], positions, None)
            yield k, h

    def training_loss(self, batch: FeatureBatch, target) -> tuple[torch.Tensor, dict[str, float]]:
        """Module k at position i learns the target's distribution at position i+k+1 (KL to its soft labels, the
        teacher's logits being lm_head(hidden) along the same sequence); the figures are each module's top-1
        agreement with the target."""
        hidden = batch.hidden[int(self.target_config["num_layers"])]
        with torch.no_grad():
            teacher = self.logits(target, hidden).float().log_softmax(-1)               # [B, L, V]
        total, figures = 0.0, {}
        for k, out in self.chain(target, batch.tokens, hidden):
            n = out.shape[1] - 1                                                          # last one has no label
            want = teacher[:, k + 1:k + 1 + n]
            mask = batch.loss_mask[:, k + 1:k + 1 + n].float()
            logp = self.logits(target, out[:, :n]).float().log_softmax(-1)
            kl = (want.exp() * (want - logp)).sum(-1)                                     # [B, n]
            loss_k = (kl * mask).sum() / mask.sum().clamp(min=1)
            total = total + loss_k
            hit = (logp.argmax(-1) == want.argmax(-1)).float()
            figures[f"acc{k + 1}"] = float((hit * mask).sum() / mask.sum().clamp(min=1))
            figures[f"kl{k + 1}"] = float(loss_k.detach())
        return total, figures


def _causal(positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive causal mask [B, 1, W, W] over right-padded positions (padding keys masked, each query sees itself)."""
    batch, width = positions.shape
    allowed = torch.ones(width, width, dtype=torch.bool, device=positions.device).tril()[None]
    allowed = allowed & (positions >= 0)[:, None, :] | torch.eye(width, dtype=torch.bool, device=positions.device)
    neg = torch.finfo(dtype).min
    return torch.where(allowed, 0.0, neg).to(dtype)[:, None]


def arch_of(head: MtpHead) -> str:
    return head.target_config["arch"].get("model_type", "")
