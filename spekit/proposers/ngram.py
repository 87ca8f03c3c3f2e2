"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the context's last n tokens (longest
n first) in the prompt and the generated text, and propose the tokens that followed it.

The index is built incrementally (a dict per n from n-gram to where its continuation starts), so a lookup costs
O(1) however long the context grows. Drafting only pays when the step gains more than a multi-token forward
costs over a one-token forward; that cost ratio is measured by the engine, and a draft is offered only when
the measured acceptance for its match length pays for it, so decoding never slows down where nothing matches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import UserError
from ..tree import DraftTree, chain
from .base import Proposer, StepContext, register


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

    def begin(self, ctx: StepContext) -> None:
        o = self.options
        self.index = [[_Index(n) for n in range(o.ngram_min, o.ngram_max + 1)] for _ in ctx.tokens]
        # per row and match length: accepted tokens per draft, EMA (per row, so rows do not steer each other)
        self.gain = [{n: 2.0 for n in range(o.ngram_min, o.ngram_max + 1)} for _ in ctx.tokens]
        self.last_n: list[int] = [0] * len(ctx.tokens)

    def propose(self, ctx: StepContext) -> DraftTree:
        k = self.options.num_draft_tokens
        drafts, lengths = [], []
        for b, tokens in enumerate(ctx.tokens):
            cont, n = self._lookup(b, tokens)
            worth = n > 0 and self.gain[b][n] > ctx.verify_cost - 1
            if n > 0 and not worth:
                self.gain[b][n] += 0.02        # drift back to optimism so a changed text gets another chance
            cont = cont[: min(k, ctx.room[b])] if worth else []
            self.last_n[b] = n if cont else 0
            drafts.append(cont + [0] * (k - len(cont)))
            lengths.append(len(cont))
        width = max(lengths)
        device = ctx.pending.device
        draft = torch.tensor([d[:width] for d in drafts], dtype=torch.long, device=device)
        return chain(ctx.pending, draft, torch.tensor(lengths, device=device))

    def _lookup(self, b: int, tokens: list[int]) -> tuple[list[int], int]:
        for idx in reversed(self.index[b]):
            idx.extend(tokens)
            start = idx.table.get(tuple(tokens[-idx.n:]))
            if start is not None and len(tokens) >= idx.n:
                return tokens[start:start + self.options.num_draft_tokens], idx.n
        return [], 0

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]]) -> None:
        for b, n in enumerate(self.last_n):
            if n:
                self.gain[b][n] = 0.8 * self.gain[b][n] + 0.2 * (len(gained[b]) - 1)

    def select_rows(self, rows: list[int]) -> None:
        self.index = [self.index[r] for r in rows]
        self.gain = [self.gain[r] for r in rows]
        self.last_n = [self.last_n[r] for r in rows]
