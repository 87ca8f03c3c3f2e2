"""The drawing half of a chain drafter's loop (`draft`, `early-exit`, `layer-skip`): one token per row a step from
the drafter's logits, each row going on while it is under its draft length and, greedy, while the drafter is at
least `confidence` sure; at the end, the chain the engine verifies. The drafters differ only in how they get the
next logits."""
from __future__ import annotations

import torch

from ..sampling import Seen, draft_tokens
from ..tree import DraftTree, chain
from .base import StepContext, all_stopped


class ChainDraw:
    def __init__(self, ctx: StepContext, want: list[int], seen: Seen | None, confidence: float,
                 device: torch.device):
        self.ctx, self.want, self.seen, self.confidence = ctx, want, seen, confidence
        self.want_t = torch.tensor(want, device=device)
        self.active = self.want_t > 0                                      # [B] rows still drafting
        self.lengths = torch.zeros(len(want), dtype=torch.long, device=device)
        self.tokens: list[torch.Tensor] = []                               # [B] each
        self.qs: list[torch.Tensor | None] = []                            # [B, V] each, None when greedy

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """The next draft token per row from the drafter's logits [B, V] -> [B]."""
        step, cfg = len(self.tokens), self.ctx.cfg
        drawing = [b for b, w in enumerate(self.want) if w > step]       # who draws under sampling (host)
        tok, q, conf = draft_tokens(logits, cfg, self.ctx.gens, self.seen, drawing)
        self.tokens.append(tok)
        self.qs.append(q)
        self.lengths += self.active.long()
        self.active &= self.want_t > step + 1
        if cfg.greedy:
            self.active &= conf >= self.confidence
        if self.seen is not None:
            self.seen.add(torch.arange(len(self.want), device=tok.device), tok)
        return tok

    @property
    def done(self) -> bool:
        """Every row's draft is complete (as far as can be told without a read from the device)."""
        return len(self.tokens) == max(self.want) or all_stopped(self.active)

    def chain(self) -> tuple[DraftTree, list[int]]:
        """(the drafted chain under the pending tokens, each row's draft length)."""
        pending, offered = self.ctx.pending, self.lengths.tolist()
        width = max(offered)               # the same tree whether or not the loop stopped early
        if not width:
            return chain(pending, pending[:, None][:, :0], self.lengths.to(pending.device)), offered
        draft = torch.stack(self.tokens, dim=1)[:, :width]                          # [B, width]
        q = None if self.ctx.cfg.greedy else torch.stack(self.qs, dim=1)[:, :width]  # [B, width, V]
        return chain(pending, draft.to(pending.device), self.lengths.to(pending.device),
                     None if q is None else q.to(pending.device)), offered
