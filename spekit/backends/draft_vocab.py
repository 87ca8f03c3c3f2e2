"""A reduced draft vocabulary for a draft model: its LM head computes logits only for the target tokens it is
likely to propose (the most frequent tokens of the target's own answers) and returns -inf for the rest.

Why: a one-layer draft of SmolLM2-135M spends most of its forward in the LM head (49152 x 576 = 28M of its ~32M
multiply-adds per token). With 8192 tokens the head costs a sixth of that. The draft's distribution q is then zero outside the subset, which changes nothing in the core's
guarantee: greedy verification accepts only the target's argmax, and under sampling the rejection rule is exact for
any q (the residual max(0, p - q) restores the target's mass on the tokens the draft cannot propose).

A draft folder written by `spekit train draft --draft-vocab N` carries the target ids in config.json
(`spekit.draft_vocab`); `spekit.backends.torch_models.load_model` gives such a model its reduced head."""
from __future__ import annotations

import torch

from ..config import UserError


class ReducedHead(torch.nn.Module):
    """LM head over the target ids `ids` [Vd] of a full head's weight [V, H]; returns full-size logits [..., V],
    -inf outside `ids` (so every caller still sees the model's vocabulary)."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("ids", ids.to(weight.device, torch.long))
        self.inner = torch.nn.Linear(self.in_features, len(ids), bias=bias is not None,
                                     device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.inner.weight.copy_(weight[self.ids])
            if bias is not None:
                self.inner.bias.copy_(bias[self.ids])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self.inner(x)                                                    # [..., Vd]
        out = small.new_full((*small.shape[:-1], self.out_features), float("-inf"))
        return out.index_copy_(-1, self.ids, small)                              # [..., V]


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of counts [V], sorted ascending. Ties (above all the tokens never
    seen) go to the lower id: BPE vocabularies number their tokens in merge order, roughly by frequency. On
    SmolLM2-135M, 1381 distilled answers hold 7135 distinct tokens; their 8192 most frequent cover 86% of the
    target's answer tokens on Spec-Bench questions, 87.6% with the low ids after them (16384: 93%)."""
    if size < 1:
        raise UserError(f"a draft vocabulary needs at least 1 token, got {size}")
    size = min(size, counts.numel())
    order = torch.arange(counts.numel(), 0, -1, dtype=torch.float64) / (counts.numel() + 1)   # (0, 1]
    return (counts.double() + order).topk(size).indices.sort().values


def reduce_head(model: torch.nn.Module, ids: list[int] | torch.Tensor) -> None:
    """Give a causal LM a ReducedHead over `ids` (in place). Raises UserError when the ids do not fit its
    vocabulary."""
    head = model.get_output_embeddings()
    ids = torch.as_tensor(ids, dtype=torch.long)
    vocab = head.weight.shape[0]
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel():
        raise UserError(f"the draft vocabulary must be distinct token ids below {vocab} "
                        f"(got {ids.numel()} ids in [{int(ids.min()) if ids.numel() else '-'}, "
                        f"{int(ids.max()) if ids.numel() else '-'}])")
    model.set_output_embeddings(ReducedHead(head.weight.detach(), ids, getattr(head, "bias", None)))


def apply_saved(model: torch.nn.Module) -> bool:
    """Reduce the head of a model whose config carries `spekit.draft_vocab` (a spekit draft). Returns whether
    it did."""
    info = getattr(model.config, "spekit", None)
    ids = info.get("draft_vocab") if isinstance(info, dict) else None
    if not ids:
        return False
    reduce_head(model, ids)
    return True
