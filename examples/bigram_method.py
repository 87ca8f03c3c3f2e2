"""Your own drafting method in one file: a proposer that follows bigrams of the text so far (the token that came
after the pending token last time, then after that one, ...). spekit's core verifies its drafts, so it is
lossless without any work here; it appears in every command once imported:

    SPEKIT_PLUGINS=examples/bigram_method.py spekit generate --method bigram --max-draft 6 "Count: one, two, one, two,"
    SPEKIT_PLUGINS=examples/bigram_method.py spekit bench --methods plain,bigram,ngram --limit 1 --max-new-tokens 64

(an installed package would name the module in its entry points instead: see spekit/plugins.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spekit.config import UserError
from spekit.proposers import Proposer, StepContext, register
from spekit.tree import DraftTree, chain


@dataclass(frozen=True)
class BigramOptions:              # each field becomes a flag (--max-draft) and a server option
    max_draft: int = 4            # most tokens drafted a step

    def __post_init__(self) -> None:
        if self.max_draft < 1:
            raise UserError(f"max_draft must be >= 1, got {self.max_draft}")


@register
class Bigram(Proposer):
    name = "bigram"
    Options = BigramOptions
    help = "follow the bigrams of the text so far (an example plugin)"

    def begin(self, ctx: StepContext, hidden=None) -> None:
        self.follows: list[dict[int, int]] = []      # per row: token -> the token that followed it last
        self.seen: list[int] = []                    # per row: how much of its text is indexed
        self.add_rows(ctx)

    def add_rows(self, ctx: StepContext, hidden=None) -> None:     # rows joining a server's running batch
        self.follows += [{} for _ in ctx.tokens]
        self.seen += [0] * len(ctx.tokens)

    def select_rows(self, rows: list[int]) -> None:                # rows leaving the batch
        self.follows = [self.follows[r] for r in rows]
        self.seen = [self.seen[r] for r in rows]

    def propose(self, ctx: StepContext) -> DraftTree:
        drafts = []
        for b, tokens in enumerate(ctx.tokens):
            table = self.follows[b]
            for i in range(max(1, self.seen[b]), len(tokens)):
                table[tokens[i - 1]] = tokens[i]
            self.seen[b] = len(tokens)
            draft, last = [], tokens[-1]
            while len(draft) < min(self.options.max_draft, ctx.room[b]) and last in table:
                last = table[last]
                draft.append(last)
            drafts.append(draft)
        width = max(len(d) for d in drafts)
        device = ctx.pending.device
        padded = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long, device=device)
        return chain(ctx.pending, padded.view(len(drafts), width), torch.tensor([len(d) for d in drafts],
                                                                                device=device))
