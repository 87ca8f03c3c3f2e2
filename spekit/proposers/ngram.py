"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the context's last n tokens (longest
n first) in the prompt and the generated text, and propose the tokens that followed it.

The index is built incrementally (a dict per n from n-gram to where its continuation starts), so a lookup costs
O(1) however long the context grows. Each row estimates how often its drafts are accepted, per match length;
the batch drafts the width that gives the most tokens per unit of verification cost (`Budget.chain_widths`, with
the cost of a forward over k tokens per row measured by the engine for this batch size); where nothing matches
or drafts do not pay, the step is a plain one-token step, so decoding never slows down. A row that matched but
did not draft still learns: its match's next token is held against the token the step committed (a shadow
draft, free), so that where wide forwards are dear (llama.cpp on a CPU) a run of copies is found out without
paying for drafts first.

Under structured output, where the row's grammar forces the next tokens (a JSON schema's keys and punctuation,
StepContext.forced), those are the draft instead, with acceptance estimates of their own (`GRAMMAR`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import UserError
from ..pacing.odds import ChainOdds
from ..tree import DraftTree, chain
from .base import Proposer, StepContext, register

GRAMMAR = 0       # the estimates' key for drafts of grammar-forced tokens (the others: the match length n)


@dataclass(frozen=True)
class NgramOptions:
    num_draft_tokens: int = 10     # longest continuation proposed
    ngram_max: int = 4             # longest suffix matched
    ngram_min: int = 1             # shortest suffix matched

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise UserError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise UserError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")


class _Index:
    """n-gram -> start of the continuation of its latest occurrence, for one row and one n."""

    def __init__(self, n: int):
        self.n, self.table, self.seen = n, {}, 0

    def extend(self, tokens: list[int]) -> None:
        # register every n-gram that now has at least one token after it
        for end in range(max(self.n, self.seen), len(tokens)):
            self.table[tuple(tokens[end - self.n:end])] = end
        self.seen = max(self.seen, len(tokens))


@register
class Ngram(Proposer):
    name = "ngram"
    Options = NgramOptions
    help = "prompt lookup: continue a repeated n-gram from the prompt or the text so far"

    def begin(self, ctx: StepContext, hidden=None) -> None:
        self.index, self.hits, self.offered, self.shadow, self.streak = [], [], [], [], []
        # greedy batches: tokens the last width promised beyond one per row, and the running ratio of extra tokens
        # gained to extra tokens promised. A large batch pays for every row's optimism (a fresh row's prior, a
        # unigram match), so the batch's own record tempers the rows' estimates.
        self.promised, self.kept = 0.0, 1.0
        self.add_rows(ctx)

    def add_rows(self, ctx: StepContext, hidden=None) -> None:
        o = self.options
        self.index += [[_Index(n) for n in range(o.ngram_min, o.ngram_max + 1)] for _ in ctx.tokens]
        # per row and match length n, the odds of its drafts (first token, later ones given the one before). Per
        # row, so rows do not steer each other; the prior is mildly optimistic.
        self.hits += [{**{n: ChainOdds((1.0, 1.0, 2.0, 1.0)) for n in range(o.ngram_min, o.ngram_max + 1)},
                       GRAMMAR: ChainOdds((9.0, 1.0, 9.0, 1.0))} for _ in ctx.tokens]
        self.offered += [(0, 0)] * len(ctx.tokens)     # (n, k) drafted last step
        self.shadow += [None] * len(ctx.tokens)        # (n, token): the match's next token, where none was drafted
        self.streak += [False] * len(ctx.tokens)       # the row's last shadow draft was right

    def propose(self, ctx: StepContext) -> DraftTree:
        forced = ctx.forced or [[]] * len(ctx.tokens)
        found = [(f[: self.options.num_draft_tokens], GRAMMAR) if f else self._lookup(b, tokens)
                 for b, (tokens, f) in enumerate(zip(ctx.tokens, forced))]
        rows = []
        for b, (cont, n) in enumerate(found):
            first, later = self.hits[b][n].rates() if cont else (0.0, 0.0)
            rows.append((first, later, min(len(cont), ctx.room[b])))
        # greedy: one width for the batch (every row pays for the widest draft), from the rows' own estimates scaled
        # (batches only) by how well the batch's raw promises were kept; sampled: per row, so that a row's sample
        # does not depend on its batch
        widths = ctx.budget.chain_widths(rows, self.kept if ctx.cfg.greedy and len(rows) > 1 else 1.0)
        if ctx.cfg.greedy:
            self.promised = sum(ctx.budget.gain(f, c, k) - 1 for (f, c, _), k in zip(rows, widths))
        drafts = []
        for b, ((cont, n), k) in enumerate(zip(found, widths)):
            self.shadow[b] = (n, cont[0]) if cont and k == 0 else None
            self.offered[b] = (n, k)
            drafts.append(cont[:k])
        width = max(len(d) for d in drafts)
        device = ctx.pending.device
        draft = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long, device=device)
        return chain(ctx.pending, draft, torch.tensor([len(d) for d in drafts], device=device))

    def _lookup(self, b: int, tokens: list[int]) -> tuple[list[int], int]:
        for idx in reversed(self.index[b]):
            idx.extend(tokens)
            start = idx.table.get(tuple(tokens[-idx.n:]))
            if start is not None and len(tokens) >= idx.n:
                return tokens[start:start + self.options.num_draft_tokens], idx.n
        return [], 0

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]], hidden=None) -> None:
        if ctx.cfg.greedy and self.promised > 0:
            extra = sum(len(g) - 1 for g in gained)
            self.kept = min(1.5, max(0.05, 0.8 * self.kept + 0.2 * extra / self.promised))
        elif ctx.cfg.greedy:
            self.kept = min(1.0, self.kept + 0.01)     # no draft this step: drift back, the text may change
        for b, shadow in enumerate(self.shadow):
            if shadow is not None:
                self._shadow_verdict(b, *shadow, gained[b][0])
            else:
                self.streak[b] = False
        for b, (n, k) in enumerate(self.offered):
            if k:
                self.hits[b][n].learn(len(gained[b]) - 1, k)

    def _shadow_verdict(self, b: int, n: int, guess: int, token: int) -> None:
        """A match that was not drafted, judged by the token the step committed: its first-token estimate moves as
        a drafted one's would, and two right shadows in a row count as a continued copy."""
        right = guess == token
        self.hits[b][n].judge(right, self.streak[b])
        self.streak[b] = right

    def select_rows(self, rows: list[int]) -> None:
        self.index = [self.index[r] for r in rows]
        self.hits = [self.hits[r] for r in rows]
        self.offered = [self.offered[r] for r in rows]
        self.shadow = [self.shadow[r] for r in rows]
        self.streak = [self.streak[r] for r in rows]
