"""EAGLE-3 head (Li et al. 2025): fused low, middle and high features, direct token prediction over a reduced
draft vocabulary, trained with training-time test.

- `fc` fuses the target's hidden states after decoder layers (2, L/2, L-3) (FeatureBatch numbering) into one
  vector of the hidden size; deeper drafts feed on the head's own output instead.
- The decoder layer (`midlayer`, transformers' own LlamaDecoderLayer with its q/k/v projections widened to take
  [norm(embedding), norm(feature)] side by side, as the EAGLE-3 checkpoints vLLM and SGLang load have it) is run
  through its own submodules; `norm` and `lm_head` give logits over `draft_vocab_size` tokens.
- The draft vocabulary is the most frequent target tokens of the training data (`choose_vocab`): `d2t[i]` is
  the offset with target id = i + d2t[i], `t2d[t]` says whether target token t is in it.
- Loss: the cross-entropy of each unrolled step's distribution against the target's (restricted to the draft
  vocabulary and renormalised), steps weighted 0.8^j as the paper's code does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import UserError
from .base import FeatureBatch, register_head, target_info
from .eagle import EagleBase, LayerShape, llama_config, soft_ce, target_shape, top1


@dataclass(frozen=True)
class Eagle3Config(LayerShape):
    draft_vocab_size: int = 8192
    ttt_steps: int = 3                        # training-time test: unrolled steps per training position
    layers: tuple = ()                        # hidden-state indices fused; () = (2, L/2, L-3)

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise UserError(f"--ttt-steps must be >= 1, got {self.ttt_steps}")


@register_head
class Eagle3Head(EagleBase):
    kind = "eagle3"
    Config = Eagle3Config

    def __init__(self, config: Eagle3Config, target_config: dict):
        super().__init__(config, target_config)
        h, vocab = config.hidden_size, int(target_config["vocab_size"])
        if not 0 < config.draft_vocab_size <= vocab:
            raise UserError(f"draft_vocab_size must be in 1..{vocab}, got {config.draft_vocab_size}")
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
        lc = llama_config(config, vocab)
        self.fc = torch.nn.Linear(3 * h, h, bias=False)
        self.midlayer = LlamaDecoderLayer(lc, layer_idx=0)
        attn = self.midlayer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, torch.nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.midlayer.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(lc)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
        self.choose_vocab(torch.arange(vocab, 0, -1, dtype=torch.float))   # placeholder: the lowest ids

    @classmethod
    def create(cls, target, **options) -> "Eagle3Head":
        options = {**target_shape(target), **options}
        options["layers"] = tuple(options.get("layers") or ())
        return cls(cls.Config(**options), target_info(target))

    def feature_layers(self) -> list[int]:
        n = int(self.target_config["num_layers"])
        return list(self.config.layers) or [2, n // 2, n - 3]

    def training_layers(self) -> list[int]:
        return self.feature_layers() + [int(self.target_config["num_layers"])]

    def choose_vocab(self, counts: torch.Tensor) -> None:
        """Make the draft vocabulary the draft_vocab_size most frequent target tokens: counts [V]."""
        top = counts.float().topk(self.config.draft_vocab_size).indices.sort().values
        self.d2t.copy_(top - torch.arange(len(top), device=top.device))
        self.t2d.zero_()
        self.t2d[top] = True

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Start `norm` and `lm_head` from the target's final norm and its LM head's rows for the draft vocabulary
        (call after choose_vocab), an output space that already fits the tokens instead of Vd x H random weights.
        On SmolLM2-135M the first 90 steps' top-1 was no better than from random weights (0.21-0.29 either way)."""
        self.norm.weight.copy_(target.model.get_decoder().norm.weight.to(self.norm.weight.dtype))
        lm = target.model.get_output_embeddings().weight[self.draft_ids.to(target.device)]
        self.lm_head.weight.copy_(lm.to(self.lm_head.weight.device, self.lm_head.weight.dtype))

    @property
    def draft_ids(self) -> torch.Tensor:
        """[Vd] target id of each draft token."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        return self.fc(feats)

    def decode(self, emb, inp, positions, mask, cache, rope) -> torch.Tensor:
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(inp)], dim=-1)
        attn, _ = layer.self_attn(hidden_states=x, attention_mask=mask, position_ids=positions, cache=cache,
                                  use_cache=True, position_embeddings=rope)
        h = inp + attn
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def draft_logits(self, out: torch.Tensor, target=None) -> torch.Tensor:
        """[B, N, H] -> [B, N, Vd] over the draft vocabulary."""
        return self.lm_head(self.norm(out))

    def training_loss(self, batch: FeatureBatch, target) -> tuple[torch.Tensor, dict[str, float]]:
        missing = [i for i in self.training_layers() if i not in batch.hidden]
        if missing:
            raise UserError(f"the batch lacks hidden layers {missing}, which an eagle3 head trains on")
        last = batch.hidden[int(self.target_config["num_layers"])]
        weight_rows = target.model.get_output_embeddings().weight[self.draft_ids]           # [Vd, H]
        with torch.no_grad():   # the target's distribution restricted to the draft vocabulary, renormalised
            probs_all = (last.to(weight_rows.dtype) @ weight_rows.T).float().softmax(-1)   # [B, L, Vd]
        total, figures, weight = 0.0, {}, 0.0
        for j, out, valid in self.unroll(batch, target, self.config.ttt_steps):
            idx = (torch.arange(out.shape[1], device=out.device) + 1 + j).clamp(max=last.shape[1] - 1)
            probs = probs_all[:, idx]
            logits = self.draft_logits(out)
            ce = soft_ce(logits, probs, valid)
            total = total + 0.8 ** j * ce
            weight += 0.8 ** j
            figures[f"ce{j}"] = float(ce.detach())
            figures[f"top1_{j}"] = top1(logits, probs, valid)
        loss = total / weight
        figures["loss"] = float(loss.detach())
        return loss, figures
