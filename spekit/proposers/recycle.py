"""Token recycling (`--method recycle`, after Luo et al. 2024, "Turning Trash into Treasure: Accelerating
Inference of Large Language Models with Token Recycling"): no draft model, no datastore, no training.

Every verification forward computes the target's distribution at every node of the tree, the rejected nodes
too. Their `candidates` likeliest next tokens are kept per node token in an adjacency table: token -> the k
tokens the target ranked first after it, the last time it ran on it. A step drafts, from the pending token, the
tree found by following that table: a node's children are its token's candidates. Each node's chance is the
product, along its path, of the acceptance rate the row has measured for a child of that rank at that depth
(decayed counts of children accepted when their parent was). The most likely nodes are drafted, as many as pay
for the measured cost of the wider forward (`Budget.node_counts`); none where none pays (never slower than
plain).

Greedy steps share one table across the rows and the generations of a process (the paper keeps it across
queries: most of what it holds is the model's habits, not one text's); sampled rows each build their own from
their own forwards only, so that a seeded sample depends on its seed and its text alone. Lossless: the drafts
are point masses, verified by the core's tree walk (greedy) or its recursive rejection rule (sampling). Under
structured output the text the grammar forces next is grafted onto the tree (`tree.with_forced`).
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass

from ..config import UserError
from ..tree import DraftTree, best_chain, from_sequences, with_forced
from .base import Proposer, StepContext, register
from .resting import Idle, Resting

PRIOR = (0.45, 0.15, 0.08, 0.05)     # chance of a child of rank 0, 1, 2, 3 (later ranks: the last) before counts
PRIOR_WEIGHT = 2.0                   # the prior counts as this many offered children
DEPTHS = 3                           # rates are kept for depth 1, 2 and 3 or more
DECAY = 0.97                         # per drafted step, the weight of the older counts


@dataclass(frozen=True)
class RecycleOptions:
    candidates: int = 8          # next tokens kept per token in the adjacency table (k)
    tree_size: int = 24          # most draft nodes per row and step
    num_draft_tokens: int = 8    # deepest draft

    def __post_init__(self) -> None:
        for name in ("candidates", "tree_size", "num_draft_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")


IDLE, REFRESH = 8, 4      # after IDLE steps without a draft, a sampled row's table is refreshed every REFRESH-th step
TOPK_SHARE, LONGEST = 0.005, 16   # greedy: the share of a plain step idle rows' refreshes may cost; the most steps apart


class Recycler:
    """One row's drafting from the adjacency table: the table (a shared one at greedy steps), the rates per
    (depth, rank) as [accepted, offered], and the nodes it offered last step as (path, rank). Also a source of
    `rest` (`--recycle`)."""

    def __init__(self, table: dict[int, list[int]], k: int):
        self.table = table
        self.rates = {(d, r): [PRIOR_WEIGHT * PRIOR[min(r, len(PRIOR) - 1)], PRIOR_WEIGHT]
                      for d in range(1, DEPTHS + 1) for r in range(k)}
        self.plan: list[tuple[tuple[int, ...], int]] = []
        self.shadow: int | None = None   # where nothing was drafted: the table's first guess after the root
        self.streak = 0                   # shadow guesses right in a row (the depth the next one stands for)
        self.idle = Idle()                # steps in a row that drafted nothing (`refreshes` counts; resting.py reads)

    def refreshes(self, every: int = REFRESH) -> bool:
        """Whether this step's logits go into the table (called once a step, before `learn`): always while the row
        drafts, else for IDLE steps and then every `every`-th (`Refreshing`)."""
        idle = self.idle
        idle.steps = 0 if self.plan else idle.steps + 1
        return idle.steps < IDLE or idle.steps % every == 0

    def chance(self, depth: int, rank: int) -> float:
        ok, offered = self.rates[(min(depth, DEPTHS), rank)]
        return ok / offered

    def rank(self, root: int, size: int, depth: int) -> list[tuple[tuple[int, ...], float, int]]:
        """The `size` likeliest nodes reachable from `root` through the table, at most `depth` deep, most likely
        first (a parent before its children): (path, chance, rank among its siblings)."""
        order = itertools.count()
        heap: list = []

        def push(path: tuple[int, ...], chance: float) -> None:
            nxt = self.table.get(path[-1] if path else root)
            if nxt is None or len(path) >= depth:
                return
            for r, tok in enumerate(nxt):
                heapq.heappush(heap, (-chance * self.chance(len(path) + 1, r), next(order), path + (tok,), r))

        push((), 1.0)
        nodes = []
        while heap and len(nodes) < size:
            neg, _, path, r = heapq.heappop(heap)
            nodes.append((path, -neg, r))
            push(path, -neg)
        return nodes

    def update(self, tokens: list[int], valid: list[bool], top: list[list[int]]) -> None:
        """After a forward over nodes `tokens` (the valid ones): top[i], the target's likeliest next tokens after
        node i, replace what the table held for its token."""
        for tok, ok, nxt in zip(tokens, valid, top):
            if ok:
                self.table[tok] = nxt

    def guess(self, root: int) -> None:
        """Nothing drafted this step: keep the table's first guess after the root, to judge it for free."""
        nxt = self.table.get(root)
        self.shadow = nxt[0] if nxt else None

    def learn(self, got: list[int]) -> None:
        """got: the step's committed tokens (the accepted drafts, then the next token). A step that drafted nothing
        judges its shadow guess instead, as a first-rank node at the depth its streak of right guesses reached (where
        wide forwards are dear, a row otherwise would have to pay for drafts to learn they now pay)."""
        if not self.plan:
            if self.shadow is not None:
                c = self.rates[(min(self.streak + 1, DEPTHS), 0)]
                right = got[0] == self.shadow
                c[0], c[1] = DECAY * c[0] + right, DECAY * c[1] + 1.0
                self.streak = self.streak + 1 if right else 0
            else:
                for d in range(1, DEPTHS + 1):      # no guess to judge: drift back to optimism, the text may change
                    c = self.rates[(d, 0)]
                    c[0] = min(c[0] + 0.01 * c[1], c[1])
            self.shadow = None
            return
        self.streak = 0
        for c in self.rates.values():
            c[0] *= DECAY
            c[1] *= DECAY
        accepted = {tuple(got[:d]) for d in range(1, len(got))}
        for path, r in self.plan:
            if len(path) == 1 or path[:-1] in accepted:
                c = self.rates[(min(len(path), DEPTHS), r)]
                c[0] += path in accepted
                c[1] += 1.0
        self.plan = []


class Refreshing:
    """How often a row that drafts nothing puts a plain step's logits into its table. The top-k over the vocabulary
    is the table's own cost, paid whether or not a draft comes of it: at greedy steps an idle row refreshes as often
    as keeps it near TOPK_SHARE of a plain step, as measured (every step where steps are long, every few where a
    small model's step on a CPU backend is short against a top-k over a 262k-token head); under sampling every
    `sampled`-th step, whatever the clock says, so that a seed alone fixes a row's drafts."""

    def __init__(self, sampled: int) -> None:
        self.greedy_every, self.sampled = 1, sampled

    def flags(self, rows: list[Recycler], greedy: bool) -> list[bool]:
        """Per row, whether this step's logits go into its table (once a step, after the rows' plans are set)."""
        every = self.greedy_every if greedy else self.sampled
        return [row.refreshes(every) for row in rows]

    def refresh(self, ctx: StepContext, rows: list[Recycler], fresh: list[bool], logits, tree: DraftTree | None,
                k: int) -> None:
        """The step's k likeliest next tokens per node into the fresh rows' tables (tree None: a plain step, the
        roots alone); at a greedy step that verified a tree, into every row's (the top-k of its nodes is paid for by
        then; a sampled row's table never depends on what its batch drafted). logits [B, N, V]."""
        every = tree is not None and ctx.cfg.greedy
        chosen = [b for b, f in enumerate(fresh) if f or every]
        if logits is None or not chosen:
            return
        start = time.perf_counter()
        if tree is None:
            top = top_candidates(logits, 1, k)
            tokens, valid = [[t[-1]] for t in ctx.tokens], [[True]] * len(ctx.tokens)
        else:
            top = top_candidates(logits, tree.size, k)
            tokens, valid = tree.tokens.tolist(), tree.valid.tolist()
        plain = ctx.budget.plain_s
        if tree is None and ctx.cfg.greedy and plain:
            share = (time.perf_counter() - start) / plain
            self.greedy_every = max(1, min(LONGEST, math.ceil(share / TOPK_SHARE)))
        for b in chosen:
            rows[b].update(tokens[b], valid[b], top[b])


def top_candidates(logits, nodes: int, k: int) -> list[list[list[int]]]:
    """The k likeliest next tokens at each of the first `nodes` positions: logits [B, N, V] -> [B, nodes, k]."""
    return logits[:, :nodes].topk(k, dim=-1).indices.tolist()


@register
class Recycle(Proposer):
    name = "recycle"
    Options = RecycleOptions
    needs_logits = True
    help = "token recycling: a tree from the target's top-k next tokens, kept from every earlier forward"

    def __init__(self, target, options, draft=None):
        super().__init__(target, options, draft)
        if options.candidates > target.vocab_size:
            raise UserError(f"candidates must be at most the vocabulary ({target.vocab_size}), got "
                            f"{options.candidates}")
        self.shared: dict[int, list[int]] = {}     # greedy steps' table, kept across generations
        self.rows: list[Recycler] = []
        self.tree: DraftTree | None = None          # this step's tree; None: no row drafted (the roots alone)
        self.fresh: list[bool] = []                 # per row: this step's logits go into its table
        self.resting = Resting()                    # how often a row that drafts nothing ranks its tree
        self.refreshing = Refreshing(REFRESH)       # how often its table takes a plain step's logits

    def forget(self) -> None:
        """Drop the table the earlier generations built (after a warm-up on a prompt asked again)."""
        shared, self.shared = self.shared, {}
        for row in self.rows:                   # greedy rows keep sharing one table, the new one
            row.table = self.shared if row.table is shared else {}

    def begin(self, ctx: StepContext, hidden=None) -> None:
        self.rows = []
        self.add_rows(ctx)

    def add_rows(self, ctx: StepContext, hidden=None) -> None:
        k = self.options.candidates
        self.rows += [Recycler(self.shared if ctx.cfg.greedy else {}, k) for _ in ctx.tokens]

    def propose(self, ctx: StepContext) -> DraftTree | None:
        o = self.options
        # a resting row (resting.py) ranks only every few steps; it still judges its table's first guess (`guess`)
        full = self.resting.full([row.idle for row in self.rows], ctx.cfg.greedy)
        ranked = [row.rank(tokens[-1], o.tree_size, min(o.num_draft_tokens, room)) if room and f else []
                  for row, tokens, room, f in zip(self.rows, ctx.tokens, ctx.room, full)]
        self.resting.ranked(ctx, full)
        if ctx.chains_only:
            ranked = [best_chain(nodes) for nodes in ranked]
        # greedy: one node count for the batch (every row pays for the widest tree); sampled: per row, so that a
        # row's sample does not depend on its batch
        counts = ctx.budget.node_counts(ranked)
        for row, nodes, m, tokens in zip(self.rows, ranked, counts, ctx.tokens):
            row.plan = [(path, r) for path, _, r in nodes[:m]]
            if not row.plan:
                row.guess(tokens[-1])
        # a row whose steps have drafted nothing for a while refreshes its table every few steps only (Refreshing)
        self.fresh = self.refreshing.flags(self.rows, ctx.cfg.greedy)
        if ctx.forced is None and not any(row.plan for row in self.rows):
            self.tree = None
            return None
        # every chosen path given whole: the trie merges their prefixes, siblings in the order of their chances
        # the text a grammar forces grafted on (structured output): the table learns from its nodes' logits too,
        # and the rates from the committed tokens, wherever they came from
        self.tree = with_forced(from_sequences(ctx.pending, [[list(p) for p, _ in row.plan] for row in self.rows]),
                                ctx.forced)
        return self.tree

    def reads_plain_logits(self) -> bool:
        return any(self.fresh)

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]], hidden=None, logits=None) -> None:
        self.refreshing.refresh(ctx, self.rows, self.fresh, logits, self.tree, self.options.candidates)
        for b, row in enumerate(self.rows):
            row.learn(gained[b])

    def select_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]
