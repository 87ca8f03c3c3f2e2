"""No speculation: one token per target forward, through the same engine. The baseline of every figure."""
from __future__ import annotations

from .base import Proposer, StepContext, register


@register
class Plain(Proposer):
    name = "plain"
    help = "no speculation (the baseline)"
    speculates = False

    def propose(self, ctx: StepContext) -> None:
        return None                                     # every row's root alone

    def add_rows(self, ctx: StepContext, hidden=None) -> None:
        """No per-row state."""
