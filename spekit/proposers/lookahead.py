"""Lookahead decoding (Fu et al. 2024): in one target forward, a lookahead branch runs Jacobi iterations over a
window that fills an n-gram pool, and a verification branch checks the pool's n-grams that start with the pending
token.

Lookahead branch (side nodes: run in the forward, never verified, dropped from the cache after it): N-1 levels of
W guessed tokens; level l, column i sits at position p+1+l+i (p: the pending token's) and attends the pending
token, level 0's columns up to i and the levels below it in its own column, so each column holds one Jacobi
trajectory. The target's argmax at the top level gives a new level; each column then yields an n-gram (its N-1
levels and the new token), stored in the pool under its first token, and the oldest level is dropped.

Verification branch: up to G pool n-grams whose first token is the pending token; their other N-1 tokens are
drafted as a tree (shared prefixes merged) and verified by the core's acceptance rule as point-mass drafts, so
greedy and sampled outputs are exactly the target's. The pool is also fed from the prompt and the generated text
(as prompt lookup does), most recent first; a candidate found in the text drafts on along the text after it (up to
num_draft_tokens), so a passage being copied is verified several tokens at a time, not N-1.

Backing off: a forward over k tokens per row costs more than one (Budget.cost). Each step the row drafts the number
of candidates and the branch width that give the most expected tokens per unit of cost, from its own acceptance
figures (decayed): where nothing pays, the step is a plain one-token step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import UserError
from ..tree import DraftTree, from_sequences, with_forced
from .base import Proposer, SideNodes, StepContext, register


@dataclass(frozen=True)
class LookaheadOptions:
    window: int = 4      # W: guessed positions per Jacobi level of the lookahead branch
    ngram: int = 3       # N: n-gram size; the branch keeps N-1 levels, a candidate drafts N-1 tokens
    guesses: int = 4     # G: most candidate n-grams verified per step (and kept per first token in the pool)
    num_draft_tokens: int = 8   # a candidate from the text runs on past its n-gram, up to this many tokens

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("ngram", 2), ("guesses", 1), ("num_draft_tokens", 1)):
            if getattr(self, name) < low:
                raise UserError(f"{name} must be >= {low}, got {getattr(self, name)}")


class _Row:
    """One row's lookahead state: the Jacobi levels, the n-gram pool, and how far the text was fed to the pool."""

    def __init__(self, tokens: list[int], o: LookaheadOptions):
        step = max(1, len(tokens) // o.window)
        self.levels = [[tokens[-1 - (i * step) % len(tokens)] for i in range(o.window)]]
        # first token -> continuation -> where it came from: "branch", or for the text where the n-gram starts
        self.pool: dict[int, dict[tuple[int, ...], str | int]] = {}
        self.fed = 0                                                # text n-grams starting before this are in
        self.cap, self.n, self.longest = o.guesses, o.ngram, max(o.num_draft_tokens, o.ngram - 1)
        # decayed counts: per candidate rank, [won, offered] (won: the accepted path starts with it, and with no
        # candidate ranked before it); [accepted, rejected] for a candidate's later tokens given the one before
        # was accepted; [tokens won by branch n-grams, branch columns run]. Mildly optimistic priors.
        self.ranks = [[0.5 / (k + 1), 1.0] for k in range(o.guesses)]
        self.cont = [1.0, 1.0]
        self.branch = [0.2, 1.0]

    def add(self, gram: tuple[int, ...], source: str | int) -> None:
        entries = self.pool.setdefault(gram[0], {})
        entries.pop(gram[1:], None)
        entries[gram[1:]] = source
        if len(entries) > 4 * self.cap:
            del entries[next(iter(entries))]

    def feed(self, tokens: list[int]) -> None:
        for j in range(self.fed, len(tokens) - self.n + 1):
            self.add(tuple(tokens[j:j + self.n]), j)
        self.fed = max(self.fed, len(tokens) - self.n + 1)

    def candidates(self, tokens: list[int]) -> list[tuple[tuple[int, ...], str]]:
        """The most promising continuations of the last token: text n-grams that follow the last two tokens, then
        the others, most recent first in each group. A text n-gram's continuation runs on with the text after it
        (prompt lookup's copy runs, up to `longest` tokens). Returns (continuation, "text" or "branch") pairs."""
        entries = list(reversed(self.pool.get(tokens[-1], {}).items()))
        before = tokens[-2] if len(tokens) > 1 else None
        ranked = sorted(entries, key=lambda e: e[1] == "branch" or e[1] == 0 or tokens[e[1] - 1] != before)
        return [(c, "branch") if src == "branch" else (tuple(tokens[src + 1: src + 1 + self.longest]), "text")
                for c, src in ranked[: self.cap]]


@register
class Lookahead(Proposer):
    name = "lookahead"
    Options = LookaheadOptions
    needs_logits = True
    help = "lookahead decoding: Jacobi n-gram pool and n-gram verification in one forward (no draft model)"

    def __init__(self, target, options, draft=None):
        super().__init__(target, options, draft)
        span = options.window + options.ngram - 2
        if span >= target.max_positions:
            raise UserError(f"window {options.window} and ngram {options.ngram} reach {span} positions ahead; the "
                            f"model's context is {target.max_positions} tokens")

    def begin(self, ctx: StepContext, hidden=None) -> None:
        self.rows = [_Row(tokens, self.options) for tokens in ctx.tokens]
        self.plans: list[tuple[list, int]] = []        # per row: (candidates drafted, branch columns run)
        self.tree_size = 0
        self.tally = getattr(self, "tally", {})        # for reports: tokens won by source, branch columns, steps

    def propose(self, ctx: StepContext) -> DraftTree | None:
        self.plans = []
        for b, tokens in enumerate(ctx.tokens):
            row = self.rows[b]
            row.feed(tokens)
            cands = [(c[: ctx.room[b]], s) for c, s in row.candidates(tokens)]
            no_room = ctx.room[b] == 0          # the context's end, or the engine's governor holds drafting back
            self.plans.append(([], 0) if no_room else self._plan(ctx, b, [c for c in cands if c[0]]))
        if ctx.cfg.greedy and len(self.plans) > 1 and not self._batch_pays(ctx):
            self.plans = [([], 0) for _ in self.plans]
        if ctx.forced is None and not any(cands or cols for cands, cols in self.plans):
            self.tree_size = 1
            return None                           # no row drafts nor runs a branch: a plain step
        tree = from_sequences(ctx.pending, [[list(c) for c, _ in cands] for cands, _ in self.plans])
        tree = with_forced(tree, ctx.forced)      # structured output: the text the grammar forces, grafted on
        self.tree_size = tree.size                # the side nodes' logits follow the whole tree's
        return tree

    def _batch_pays(self, ctx: StepContext) -> bool:
        """Greedy batches: each row plans alone, but the forward is as wide as the widest row's tree and branch,
        so the plans go ahead only if the expected tokens of the rows counted (Budget.counted) pay for that
        width (else a plain step): without this check a large batch pays for wide trees few rows gain from."""
        widths, counted, gain = [1], ctx.budget.counted(), 0.0
        for b, ((cands, cols), row) in enumerate(zip(self.plans, self.rows)):
            nodes = len({c[:i] for c, _ in cands for i in range(1, len(c) + 1)})
            widths.append(1 + nodes + cols * len(row.levels))
            if b in counted:
                gain += self._gain(row, len(cands), max((len(c) for c, _ in cands), default=0), cols)
        return gain / ctx.budget.cost(max(widths)) > len(counted) * ctx.budget.margin

    @staticmethod
    def _gain(row: _Row, g: int, d: int, w: int) -> float:
        """Expected tokens of a step drafting the row's first g candidates d deep and w branch columns."""
        cont = row.cont[0] / sum(row.cont)
        win = sum(won / offered for won, offered in row.ranks[:g])
        return 1 + win * sum(cont ** i for i in range(d)) + row.branch[0] / row.branch[1] * w

    def _plan(self, ctx: StepContext, b: int, cands: list) -> tuple[list, int]:
        """The candidates (the first g, cut to depth d) and branch columns w that promise the most tokens per unit
        of cost: 1 + sum of the ranks' win rates x expected run length, plus the branch's tokens per column."""
        row, o, cost = self.rows[b], self.options, ctx.budget.row_cost(b)
        best, best_rate = ([], 0), 1.0
        # a target that verifies one chain per row: the first candidate alone, no branch (it runs no side nodes)
        most, columns = (min(len(cands), 1), {0}) if ctx.chains_only else (len(cands), {0, 1, o.window})
        for g in range(most + 1):
            longest = max((len(c) for c, _ in cands[:g]), default=1)
            for d in sorted({min(d, longest) for d in (1, 2, 3, 4, 6, 8, longest)}):   # a step's Python stays small
                cut = [(c[:d], src) for c, src in cands[:g]]
                nodes = len({c[:i] for c, _ in cut for i in range(1, len(c) + 1)})
                for w in sorted(columns):
                    rate = self._gain(row, g, d, w) / cost(1 + nodes + w * len(row.levels))
                    if rate > best_rate * ctx.budget.margin:
                        best, best_rate = (cut, w), rate
        # drift back to optimism: candidates and the branch left out get another try now and then
        for k in range(len(best[0]), len(cands)):
            row.ranks[k][0] = min(row.ranks[k][0] + 0.05 / (k + 1), row.ranks[k][1])
        if not best[1]:
            row.branch[1] *= 0.98
        return best

    def side_nodes(self, ctx: StepContext) -> SideNodes | None:
        per_row = [self._branch(b, cols) for b, (_, cols) in enumerate(self.plans)]
        width = max(len(t) for t, _, _ in per_row)
        if width == 0:
            return None
        device = ctx.pending.device
        tokens = torch.zeros(len(per_row), width, dtype=torch.long)
        offsets = torch.full((len(per_row), width), -1, dtype=torch.long)
        mask = torch.zeros(len(per_row), width, width, dtype=torch.bool)
        for b, (toks, offs, allowed) in enumerate(per_row):
            m = len(toks)
            tokens[b, :m], offsets[b, :m], mask[b, :m, :m] = torch.tensor(toks), torch.tensor(offs), allowed
        offsets, tokens, mask = offsets.to(device), tokens.to(device), mask.to(device)
        positions = torch.where(offsets >= 0, ctx.positions[:, None] + offsets, -1)
        return SideNodes(tokens, positions, mask)

    def _branch(self, b: int, cols: int) -> tuple[list[int], list[int], torch.Tensor]:
        """Row b's lookahead branch over its first `cols` columns: tokens, offsets from the pending token, and the
        mask [M, M] (node l * cols + i is level l, column i)."""
        levels = [level[:cols] for level in self.rows[b].levels] if cols else []
        depth = len(levels)
        tokens = [t for level in levels for t in level]
        offsets = [1 + l + i for l in range(depth) for i in range(cols)]
        level = torch.arange(depth).repeat_interleave(cols)
        col = torch.arange(cols).repeat(depth)
        first = (level[None, :] == 0) & (col[None, :] <= col[:, None])
        own = (col[None, :] == col[:, None]) & (level[None, :] <= level[:, None])
        return tokens, offsets, first | own

    def reads_plain_logits(self) -> bool:
        return False                              # a plain step runs no branch: nothing to advance

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]], hidden=None, logits=None) -> None:
        branch = logits is not None and logits.shape[1] > self.tree_size
        guesses = logits[:, self.tree_size:].argmax(dim=-1).tolist() if branch else None
        for b, (cands, cols) in enumerate(self.plans):
            if cols and guesses is not None:    # (a target that verifies chains only runs no side nodes)
                self._advance(self.rows[b], guesses[b], cols)
            self._learn(self.rows[b], cands, cols, tuple(gained[b][:-1]))

    def _learn(self, row: _Row, cands: list, cols: int, accepted: tuple[int, ...]) -> None:
        """Update the row's decayed figures after a step that drafted `cands` and accepted `accepted`."""
        won = next((k for k, (c, _) in enumerate(cands) if accepted and c[:1] == accepted[:1]), None)
        for k in range(len(cands)):
            row.ranks[k] = [0.9 * row.ranks[k][0] + (k == won), 0.9 * row.ranks[k][1] + 1]
        if won is not None:
            c, src = cands[won]
            row.cont = [0.9 * row.cont[0] + len(accepted) - 1, 0.9 * row.cont[1] + (len(accepted) < len(c))]
            if src == "branch":
                row.branch[0] += len(accepted)
            self.tally[src] = self.tally.get(src, 0) + len(accepted)
        if cols:
            row.branch = [0.97 * row.branch[0], 0.97 * row.branch[1] + cols]
        self.tally["cols"] = self.tally.get("cols", 0) + cols
        self.tally["steps"] = self.tally.get("steps", 0) + 1

    def _advance(self, row: _Row, out: list[int], cols: int) -> None:
        """The target's argmax at the branch nodes of a row: the top level's give the next level."""
        depth = len(row.levels)
        top = out[(depth - 1) * cols: depth * cols]
        new = top + row.levels[-1][cols:]
        if depth == row.n - 1:
            for i in range(cols):
                row.add(tuple(level[i] for level in row.levels) + (top[i],), "branch")
            row.levels = row.levels[1:]
        row.levels.append(new)

    def select_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]
