"""Prompt lookup (n-gram) drafting: find the earlier place in the prompt or the text so far whose preceding tokens
agree longest with the context's end, and propose the tokens that followed it.

Lookup: the latest CANDIDATES places of the context's last token are weighed; the one whose tokens before it match
the context's end for longest (counted up to ngram_max; the latest on ties) is copied from, provided the match
reaches ngram_min. A place nearer the end than the draft is long (a loop shorter than the draft) is copied over and
over, as the text goes if the loop goes on. Each row keeps a map from token to its places, built as the text grows.

Estimates: how long a copy stays right depends mostly on how long its match is (a one-token match is a guess, a
twelve-token one usually a loop) and is bimodal (a copy ends at once, or a loop runs for dozens of tokens). Each
row keeps RunOdds per match-length bucket and learns from every copy it finds, drafted or not: the copy is followed
as the text arrives, and each of its positions counts as went on or stopped once the text is known there. So a run
of copies is found out without paying for drafts first (where wide forwards are dear, llama.cpp on a CPU), and a
long loop is not judged by the length of the drafts it was offered. The batch drafts the width that gives the most
tokens per unit of verification cost (`Budget.chain_widths`, with the cost of a forward over k tokens per row
measured by the engine for this batch size); where nothing matches or drafts do not pay, the step is a plain
one-token step, so decoding never slows down.

Under structured output, where the row's grammar forces the next tokens (a JSON schema's keys and punctuation,
StepContext.forced), those are the draft instead, with estimates of their own (`GRAMMAR`), learned from their
drafts' verdicts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import UserError
from ..pacing.odds import RunOdds
from ..tree import DraftTree, chain
from .base import Proposer, StepContext, register

GRAMMAR = -1           # the estimates' key for drafts of grammar-forced tokens (the others: the match's bucket)
BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)     # match lengths that share one estimate: up to 1, 2, ...
CANDIDATES = 16        # the latest places of the last token that a lookup weighs
DECAY = 0.7            # weight of the past at each new copy counted: loops start and end within a few copies


@dataclass(frozen=True)
class NgramOptions:
    num_draft_tokens: int = 16     # longest continuation proposed
    ngram_max: int = 12            # longest match counted (the match length keys the estimates)
    ngram_min: int = 1             # shortest match copied from

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise UserError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise UserError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")


def bucket(match: int) -> int:
    """The estimate key of a match of this many tokens."""
    return next((i for i, top in enumerate(BUCKETS) if match <= top), len(BUCKETS))


@dataclass
class _Copy:
    """A copy being followed: the text from `source` on predicts the text from `start` on; `seen` positions judged."""
    key: int
    source: int
    start: int
    seen: int = 0


class _Row:
    """One row's places of each token, its estimates per key, and the copies it follows."""

    def __init__(self, depth: int):
        self.depth, self.places, self.indexed = depth, {}, 0
        self.odds: dict[int, RunOdds] = {GRAMMAR: RunOdds(depth, (9.0, 1.0), decay=0.9)}
        self.copies: list[_Copy] = []
        self.grammar_drafted = 0               # grammar-forced tokens drafted last step

    def estimate(self, key: int) -> RunOdds:
        if key not in self.odds:
            self.odds[key] = RunOdds(self.depth, decay=DECAY)
        return self.odds[key]

    def catch_up(self, tokens: list[int]) -> None:
        """Index the new tokens; judge the followed copies on them."""
        for i in range(self.indexed, len(tokens)):
            self.places.setdefault(tokens[i], []).append(i)
        self.indexed = len(tokens)
        going = []
        for c in self.copies:
            odds = self.odds[c.key]
            while c.seen < self.depth and c.start + c.seen < len(tokens):
                # once all before it held, a copy over its own start predicts what the source did
                if tokens[c.start + c.seen] != tokens[c.source + c.seen]:
                    odds.stopped(c.seen)
                    break
                odds.went_on(c.seen)
                c.seen += 1
            else:
                if c.seen < self.depth:
                    going.append(c)
        self.copies = going

    def lookup(self, tokens: list[int], o: NgramOptions) -> tuple[list[int], int, int]:
        """(continuation, estimate key, where it is copied from) of the best earlier place, or ([], 0, -1)."""
        end = len(tokens) - 1
        best, source = 0, -1
        for p in reversed(self.places.get(tokens[end], [])[-CANDIDATES - 1:]):
            if p >= end:
                continue
            m = 1
            while m < o.ngram_max and p - m >= 0 and tokens[p - m] == tokens[end - m]:
                m += 1
            if m > best:
                best, source = m, p + 1
            if m >= o.ngram_max:
                break
        if best < o.ngram_min:
            return [], 0, -1
        period = len(tokens) - source
        return [tokens[source + i % period] for i in range(o.num_draft_tokens)], bucket(best), source

    def follow(self, key: int, source: int, start: int) -> None:
        self.estimate(key).start()
        self.copies.append(_Copy(key, source, start))


@register
class Ngram(Proposer):
    name = "ngram"
    Options = NgramOptions
    help = "prompt lookup: continue a repeated n-gram from the prompt or the text so far"

    def begin(self, ctx: StepContext, hidden=None) -> None:
        self.rows: list[_Row] = []
        # greedy batches: tokens the last width promised beyond one per row, and the running ratio of extra tokens
        # gained to extra tokens promised. A large batch pays for every row's optimism (a fresh row's prior, a
        # unigram match), so the batch's own record tempers the rows' estimates.
        self.promised, self.kept = 0.0, 1.0
        self.add_rows(ctx)

    def add_rows(self, ctx: StepContext, hidden=None) -> None:
        self.rows += [_Row(self.options.num_draft_tokens) for _ in ctx.tokens]

    def propose(self, ctx: StepContext) -> DraftTree | None:
        k_max = self.options.num_draft_tokens
        forced = ctx.forced or [[]] * len(ctx.tokens)
        found = []
        for row, tokens, f in zip(self.rows, ctx.tokens, forced):
            row.catch_up(tokens)
            found.append((f[:k_max], GRAMMAR, -1) if f else row.lookup(tokens, self.options))
        rows = [(row.estimate(key).accepted, min(len(cont), room))
                for row, (cont, key, _), room in zip(self.rows, found, ctx.room)]
        # greedy: one width for the batch (every row pays for the widest draft), from the rows' own estimates scaled
        # (batches only) by how well the batch's raw promises were kept; sampled: per row, so that a row's sample
        # does not depend on its batch
        widths = ctx.budget.chain_widths(rows, self.kept if ctx.cfg.greedy and len(rows) > 1 else 1.0)
        if ctx.cfg.greedy:
            self.promised = sum(accepted(k) for (accepted, _), k in zip(rows, widths))
        drafts = []
        for row, tokens, (cont, key, source), k in zip(self.rows, ctx.tokens, found, widths):
            if source >= 0:
                row.follow(key, source, len(tokens))
            row.grammar_drafted = k if key == GRAMMAR else 0
            drafts.append(cont[:k])
        width = max(len(d) for d in drafts)
        if width == 0:
            return None
        device = ctx.pending.device
        draft = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long, device=device)
        return chain(ctx.pending, draft.view(len(drafts), width), torch.tensor([len(d) for d in drafts],
                                                                                device=device))

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]], hidden=None) -> None:
        if ctx.cfg.greedy and self.promised > 0:
            extra = sum(len(g) - 1 for g in gained)
            self.kept = min(1.5, max(0.05, 0.8 * self.kept + 0.2 * extra / self.promised))
        elif ctx.cfg.greedy:
            self.kept = min(1.0, self.kept + 0.01)     # no draft this step: drift back, the text may change
        for row, g in zip(self.rows, gained):
            if row.grammar_drafted:                    # copies are judged as the text arrives (catch_up)
                row.odds[GRAMMAR].learn(len(g) - 1, row.grammar_drafted)

    def select_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]
