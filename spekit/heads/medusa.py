"""Medusa heads (Cai et al. 2024): K extra decoding heads over the target's last hidden state (after the final
norm). Head i (0-based) reads the state h_t at position t and predicts token t+i+2, the token after the one the
target's own LM head predicts. Each head is `num_layers` residual SiLU blocks (x + SiLU(W x + b), zero-initialised,
so an untrained head predicts what the target's LM head predicts) and an LM head: by default the target's own,
shared (nothing of it is stored), or the head's own.

`draft_vocab` > 0 restricts the heads' output to that many tokens (`token_map`: draft index -> token id, the most
frequent tokens of the training data), which makes drafting and training several times cheaper; the parameter
names (`blocks.{h}.layers.{l}`, `lm_heads.{h}`, `token_map`) are those of vLLM's Medusa layout.

Training (Medusa-1, heads only, target frozen): head i at position t is trained with the cross-entropy against the
target's own distribution at position t+i+1 (soft self-distillation), weighted 0.8^i.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import UserError
from .base import DraftVocab, FeatureBatch, Head, check_numbers, register_head


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int = 4              # K: head i predicts token t+i+2
    num_layers: int = 1             # residual blocks per head
    share_lm_head: bool = True      # use the target's LM head (stored nowhere) instead of one per head
    draft_vocab: int = 0            # 0: the target's whole vocabulary; else the heads' reduced vocabulary size
    head_decay: float = 0.8         # loss weight of head i is head_decay ** i

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 1:
            raise UserError(f"need num_heads >= 1 and num_layers >= 1, got {self.num_heads}, {self.num_layers}")
        if self.draft_vocab < 0:
            raise UserError(f"draft_vocab must be >= 0, got {self.draft_vocab}")
        check_numbers(self, 0, "head_decay")


class ResidualBlock(torch.nn.Module):
    def __init__(self, hidden: int, layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        for layer in self.layers:
            torch.nn.init.zeros_(layer.weight)
            torch.nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # [..., H] -> [..., H]
        for layer in self.layers:
            x = x + torch.nn.functional.silu(layer(x))
        return x


@register_head
class MedusaHead(DraftVocab, Head):
    kind = "medusa"
    Config = MedusaConfig

    def __init__(self, config: MedusaConfig, target_config: dict):
        super().__init__(config, target_config)
        hidden, vocab = target_config["hidden_size"], target_config["vocab_size"]
        if config.draft_vocab > vocab:
            raise UserError(f"draft_vocab {config.draft_vocab} is larger than the target's vocabulary ({vocab})")
        self.out_size = config.draft_vocab or vocab
        self.blocks = torch.nn.ModuleList(ResidualBlock(hidden, config.num_layers) for _ in range(config.num_heads))
        if not config.share_lm_head:
            self.lm_heads = torch.nn.ModuleList(torch.nn.Linear(hidden, self.out_size, bias=False)
                                                for _ in range(config.num_heads))
        self.add_token_map()                  # token_map [Vd]: draft index -> token id

    @classmethod
    def create(cls, target, **options) -> "MedusaHead":
        head = super().create(target, **options)
        if not head.config.share_lm_head:       # start from the target's LM head
            with torch.no_grad():
                weight = head.output_weight(target_lm_weight(target))
                for lm in head.lm_heads:
                    lm.weight.copy_(weight)
        return head

    def feature_layers(self) -> list[int]:
        return [self.target_config["num_layers"]]

    def output_weight(self, lm_weight: torch.Tensor) -> torch.Tensor:
        """The shared LM head's rows for the draft vocabulary: [V, H] -> [Vd, H]."""
        return lm_weight[self.token_map] if self.config.draft_vocab else lm_weight

    def forward(self, hidden: torch.Tensor, shared: torch.Tensor | None = None, heads: int | None = None):
        """hidden: [..., H] post-norm last hidden states; shared: [Vd, H] (output_weight of the target's LM head,
        needed when share_lm_head); heads: run only the first this many. Returns draft-vocabulary logits
        [K, ..., Vd]."""
        out = []
        for i, block in enumerate(self.blocks[:heads]):
            x = block(hidden)
            weight = shared if self.config.share_lm_head else self.lm_heads[i].weight
            out.append(torch.nn.functional.linear(x, weight.to(x.dtype)))
        return torch.stack(out)

    def to_tokens(self, index: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> token ids (any shape)."""
        return self.token_map[index] if self.config.draft_vocab else index

    def training_loss(self, batch: FeatureBatch, target) -> tuple[torch.Tensor, dict[str, float]]:
        if not self.vocab_chosen:        # a trainer that did not choose: this batch's tokens
            self.choose_vocab(torch.bincount(batch.tokens.flatten(), minlength=self.target_config["vocab_size"]))
        h = batch.hidden[self.target_config["num_layers"]]                         # [B, L, H]
        weight = self.output_weight(target_lm_weight(target)).to(h.dtype)          # [Vd, H]
        mask = batch.loss_mask                                                      # [B, L]
        row_of = torch.cumsum(mask.flatten(), 0).view_as(mask) - 1                 # [B, L] row in `teacher`
        with torch.no_grad():   # the target's distribution, only where some head learns it
            teacher = torch.nn.functional.linear(h[mask], weight).float().softmax(-1)   # [M, Vd]
        total, figures = h.new_zeros(()).float(), {}
        length = h.shape[1]
        for i, block in enumerate(self.blocks):
            span = length - i - 1
            learn = mask[:, i + 1:] if span > 0 else mask[:, :0]                    # [B, span] t+i+1 counts
            if not bool(learn.any()):
                continue
            x = block(h[:, :span][learn])                                           # [M_i, H] states at t
            lm = weight if self.config.share_lm_head else self.lm_heads[i].weight
            pred = torch.nn.functional.linear(x, lm).float()                       # [M_i, Vd]
            soft = teacher[row_of[:, i + 1:][learn]]                                # [M_i, Vd]
            ce = -(soft * pred.log_softmax(-1)).sum(-1).mean()
            total = total + self.config.head_decay ** i * ce
            best = soft.argmax(-1)
            top5 = pred.topk(min(5, pred.shape[-1]), dim=-1).indices
            figures[f"top1_{i}"] = float((top5[:, 0] == best).float().mean())
            figures[f"top5_{i}"] = float((top5 == best[:, None]).any(-1).float().mean())
        figures["loss"] = float(total.detach())
        return total, figures

    @torch.no_grad()
    def measured_meta(self, batch: FeatureBatch, target, topk: int = 10) -> dict:
        """{"accuracy": [K][topk]}: how often head i's c-th choice at an answer position t is the token at t+i+2
        (the distilled answers are the target's own greedy tokens). The proposer builds its static tree from
        these (and re-estimates them online)."""
        h = batch.hidden[self.target_config["num_layers"]]                         # [B, L, H]
        weight = self.output_weight(target_lm_weight(target)).to(h.dtype)          # [Vd, H]
        rows = []
        for i, block in enumerate(self.blocks):
            span = h.shape[1] - i - 2
            learn = batch.loss_mask[:, :span] & batch.loss_mask[:, i + 1: i + 1 + span] if span > 0 else None
            if learn is None or not bool(learn.any()):
                rows.append([0.0] * topk)
                continue
            pred = torch.nn.functional.linear(block(h[:, :span][learn]), weight if self.config.share_lm_head
                                              else self.lm_heads[i].weight)         # [M, Vd]
            top = self.to_tokens(pred.topk(min(topk, pred.shape[-1]), dim=-1).indices)   # [M, k]
            want = batch.tokens[:, i + 2: i + 2 + span][learn]                          # [M]
            hit = (top == want[:, None]).float().mean(0)                                # [k]
            rows.append([round(float(a), 4) for a in hit] + [0.0] * (topk - len(hit)))
        return {"accuracy": rows}


def target_lm_weight(target) -> torch.Tensor:
    """The target's LM head weight [V, H] (spekit.backends.torch_target.Target)."""
    return target.model.get_output_embeddings().weight
