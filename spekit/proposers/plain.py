"""No speculation: one token per target forward, through the same engine. The baseline of every figure."""
from __future__ import annotations

import torch

from ..tree import DraftTree, chain
from .base import Proposer, StepContext, register


@register
class Plain(Proposer):
    name = "plain"
    help = "no speculation (the baseline)"
    speculates = False

    def propose(self, ctx: StepContext) -> DraftTree:
        batch = ctx.pending.shape[0]
        empty = torch.zeros(batch, 0, dtype=torch.long, device=ctx.pending.device)
        return chain(ctx.pending, empty, torch.zeros(batch, dtype=torch.long, device=ctx.pending.device))

    def add_rows(self, ctx: StepContext, hidden=None) -> None:
        """No per-row state."""
