"""EAGLE-3 with prompt lookup (`--method eagle3-lookup`): the EAGLE-2 tree of an EAGLE-3 head and, in the same
tree, the continuation prompt lookup finds (`ngram.py`), verified together in one target forward.

The two drafters win in different places: the head where the answer is the model's own phrasing (reasoning,
open questions), the lookup where the answer copies the prompt or itself (summaries, translation, retrieval). A
forward over the union costs little more than over either where verification is memory-bound (bfloat16 on this
CPU, GPUs), so each step offers both. The lookup's chain is merged into the head's tree as a trie path
(`tree.graft`): the nodes the head already drafted are shared, the rest are appended after the head's nodes.

- Costs: the lookup drafts what pays alone (its chain costs nothing to find); the head then sizes its tree
  against what its nodes add to the cost of a forward over that chain (the head rests when nothing it can add
  pays), so a long copied span leaves the head a smaller budget.
- Learning: each part learns from what its own nodes got accepted, not from the other's: the head's calibration
  counts the accepted path while it runs through the head's nodes, the lookup's estimates count the accepted
  tokens its own chain held.
- Greedy steps verify the union, the head's tree or the lookup's chain, whichever promises the most tokens per
  unit of cost (where a forward over many tokens costs more, as float32 on this CPU, the union can cost more than
  it adds). Under sampling always the union (see `_choose`).
- Lossless: greedy, the core's walk over the tree; under sampling the appended nodes are point masses placed
  after the head's drawn siblings, which keeps the core's recursive rejection rule exact.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..tree import DraftTree, from_sequences, graft
from .base import StepContext, register
from .eagle import EagleOptions
from .eagle3 import Eagle3
from .ngram import Ngram, NgramOptions


@dataclass(frozen=True)
class EagleLookupOptions(EagleOptions, NgramOptions):
    def __post_init__(self) -> None:
        EagleOptions.__post_init__(self)
        NgramOptions.__post_init__(self)


@register
class Eagle3Lookup(Eagle3):
    name = "eagle3-lookup"
    Options = EagleLookupOptions
    help = "EAGLE-3's tree and prompt lookup's continuation in one tree, verified in one forward"

    def __init__(self, target, options, draft=None):
        super().__init__(target, options, draft)
        fields = {f.name for f in dataclasses.fields(NgramOptions)}
        self.lookup = Ngram(target, NgramOptions(**{k: getattr(options, k) for k in fields}))
        self.own_size = 0                   # the head's tree size (nodes below it are the head's)
        self.chains: list[list[int]] = []   # per row: the lookup's chain offered last step
        self.grafted = 0                    # nodes the lookup added to the head's trees (for tests and figures)

    def begin(self, ctx: StepContext, hidden=None) -> None:
        super().begin(ctx, hidden)
        self.lookup.begin(ctx)

    def propose(self, ctx: StepContext) -> DraftTree:
        chain = self.lookup.propose(ctx)                               # [B, K+1]
        k = chain.size
        base = ctx.cost(k)
        # greedy: the head sizes its tree on top of the chain; sampling: alone (the widest row's chain would make
        # a row's draft depend on its batch)
        alone = not ctx.cfg.greedy
        tree = super().propose(ctx if alone else dataclasses.replace(ctx, cost=lambda n: ctx.cost(n + k - 1) / base))
        n = tree.size
        tokens, valid = chain.tokens.tolist(), chain.valid.tolist()
        self.chains = [[t for t, v in zip(tok[1:], ok[1:]) if v] for tok, ok in zip(tokens, valid)]
        merged = graft(tree, [[c] for c in self.chains])
        pick = self._choose(ctx, merged.size, n, chain.size)
        if pick == "head":
            self.lookup.withdraw()
            self.chains = [[] for _ in self.chains]
            merged = tree
        elif pick == "lookup":         # greedy only (see _choose): point masses, no q
            self.chance, n, merged = None, 1, from_sequences(ctx.pending, [[c] for c in self.chains])
        self.own_size, self.grafted = n, self.grafted + merged.size - n
        return merged

    def _choose(self, ctx: StepContext, union: int, head: int, lookup: int) -> str:
        """Which tree to verify: the union, the head's alone or the lookup's alone, whichever promises the most
        tokens per unit of verification cost (the head's drafting is spent by now). A promise is the part's own
        estimate of its accepted tokens (overlap between the two is not subtracted). Under sampling always the
        union: the head's promise depends on its draws, and dropping drawn nodes by it would bias them."""
        if not ctx.cfg.greedy:
            return "union"
        batch = len(ctx.tokens)
        g_head = self.cal * self.chance if self.chance is not None and head > 1 else 0.0
        g_lookup = sum(self.lookup.expected)
        rates = {"union": (batch + g_head + g_lookup) / ctx.cost(union),
                 "head": (batch + g_head) / ctx.cost(head), "lookup": (batch + g_lookup) / ctx.cost(lookup)}
        return max(rates, key=rates.__getitem__)

    def _credits(self, verdict, gained: list[list[int]]) -> list[int]:
        path = verdict.path[:, 1:]                                     # [B, D]
        return ((path >= 0) & (path < self.own_size)).sum(1).tolist()

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]], hidden=None) -> None:
        super().observe(ctx, verdict, gained, hidden)
        own = [g[: _common(g[:-1], c)] + g[-1:] for g, c in zip(gained, self.chains)]
        self.lookup.observe(ctx, verdict, own)

    def select_rows(self, rows: list[int]) -> None:
        super().select_rows(rows)
        self.lookup.select_rows(rows)
        self.chains = [self.chains[r] for r in rows] if self.chains else []


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of a and b."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
