"""EAGLE-3 with retrieval (`--method eagle3-lookup`): the EAGLE-2 tree of an EAGLE-3 head and, in the same tree,
the continuations retrieval drafting finds (`rest.py`: earlier occurrences of the context's last tokens in the
context, and in the datastore of the model's own answers where one is shipped or given), verified together in one
target forward.

The two drafters win in different places: the head where the answer is the model's own phrasing (reasoning,
open questions), the lookup where the answer copies the prompt or itself (summaries, translation, retrieval) or
repeats the model's stock phrasing. A forward over the union costs little more than over either where
verification is memory-bound (native bfloat16 on a CPU, GPUs), so each step offers both. The lookup's continuations
are merged into the head's tree as trie paths (`tree.graft`): the nodes the head already drafted are shared, the
rest are appended after the head's nodes.

- Costs: the lookup drafts what pays alone (its tree costs nothing to find); the head then sizes its tree
  against what its nodes add to the cost of a forward over the lookup's, so a long copied span leaves the head a
  smaller budget.
- Learning: each part learns from what its own nodes got accepted, not from the other's: the head's calibration
  counts the accepted path while it runs through the head's nodes, the lookup's estimates count the accepted
  tokens its own continuations held.
- Greedy steps verify the union, the head's tree or the lookup's alone, whichever promises the most tokens per
  unit of cost (where a forward over many tokens costs more, as in float32 on a CPU, the union can cost more than
  it adds). Under sampling always the union (see `_choose`), but each row's head chain is sized on top of the
  row's own lookup (Budget.beneath): where the lookup holds a long continuation, the head draws less or
  nothing. (Sized alone, the union costs more than it pays where wide forwards are dear.)
- Lossless: greedy, the core's walk over the tree; under sampling the appended nodes are point masses placed
  after the head's drawn siblings, which keeps the core's recursive rejection rule exact.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..tree import DraftTree, graft, roots
from .base import StepContext, register
from .eagle import EagleOptions
from .eagle3 import Eagle3
from .rest import Rest, RestOptions


@dataclass(frozen=True)
class EagleLookupOptions(EagleOptions, RestOptions):
    recycle: int = 0        # rest's token-recycling source: off here, where on top of the head's tree it did not pay

    def __post_init__(self) -> None:
        EagleOptions.__post_init__(self)
        RestOptions.__post_init__(self)


@register
class Eagle3Lookup(Eagle3):
    name = "eagle3-lookup"
    Options = EagleLookupOptions
    help = ("EAGLE-3's tree and retrieval's continuations (as rest: the context, and the datastore when the model "
            "has one) in one tree, verified in one forward")
    grafts_forced = False          # the lookup drafts the grammar's forced text already (rest's "grammar" source)

    def __init__(self, target, options, draft=None):
        super().__init__(target, options, draft)
        fields = {f.name for f in dataclasses.fields(RestOptions)}
        # no datastore for this model: the context and the history
        self.lookup = Rest(target, RestOptions(**{k: getattr(options, k) for k in fields}))
        self.needs_logits = self.lookup.needs_logits     # `--recycle`: its table learns from the merged trees
        self.verified: DraftTree | None = None       # the tree this step verifies
        self.chains: list[list[list[int]]] = []   # per row: the lookup's continuations offered last step
        self.grafted = 0                    # nodes the lookup added to the head's trees (for tests and figures)

    def begin(self, ctx: StepContext, hidden=None) -> None:
        super().begin(ctx, hidden)
        self.lookup.begin(ctx)

    def propose(self, ctx: StepContext) -> DraftTree:
        found = self.lookup.propose(ctx)                               # [B, K+1] point masses
        if found is None:                                              # the lookup drafts nothing: its roots
            found = roots(ctx.pending)
        k = found.size
        base = ctx.budget.cost(k)
        # the head sizes its tree on top of the lookup's: greedy on the batch's widest lookup, sampling per row on
        # the row's own (the widest row's would make a row's draft depend on its batch)
        if ctx.cfg.greedy:
            on_top = dataclasses.replace(ctx, budget=dataclasses.replace(ctx.budget,
                                                                    cost=lambda n: ctx.budget.cost(n + k - 1) / base))
        else:
            beneath = [len(row.plan) for row in self.lookup.rows]
            on_top = dataclasses.replace(ctx, budget=dataclasses.replace(ctx.budget, beneath=beneath))
        tree = super().propose(on_top)
        n = tree.size
        self.chains = self.lookup.sequences
        merged = graft(tree, self.chains)
        pick = self._choose(ctx, merged.size, n, found.size)
        if pick == "head":
            self.lookup.withdraw()
            self.chains = [[] for _ in self.chains]
            merged = tree
        elif pick == "lookup":         # greedy only (see _choose): point masses, no q
            ctx.budget.trees.batch.chance, n, merged = None, 1, found
        self.own_size, self.grafted = n, self.grafted + merged.size - n
        self.verified = merged
        return merged

    def _choose(self, ctx: StepContext, union: int, head: int, lookup: int) -> str:
        """Which tree to verify: the union, the head's alone or the lookup's alone, whichever promises the most
        tokens per unit of verification cost (the head's drafting is spent by now). A promise is the part's own
        estimate of its accepted tokens (overlap between the two is not subtracted). Under sampling always the
        union: the head's promise depends on its draws, and dropping drawn nodes by it would bias them."""
        if not ctx.cfg.greedy:
            return "union"
        batch = len(ctx.budget.counted())          # the rows whose gains count (the head's chance is summed over them)
        paced = ctx.budget.trees.batch
        chance = paced.chance
        g_head = paced.cal * chance if chance is not None and head > 1 else 0.0
        g_lookup = sum(self.lookup.expected)
        cost = ctx.budget.cost
        rates = {"union": (batch + g_head + g_lookup) / cost(union), "head": (batch + g_head) / cost(head),
                 "lookup": (batch + g_lookup) / cost(lookup)}
        return max(rates, key=rates.__getitem__)

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]], hidden=None, logits=None) -> None:
        super().observe(ctx, verdict, gained, hidden)
        own = [g[: max((_common(g[:-1], c) for c in seqs), default=0)] + g[-1:]
               for g, seqs in zip(gained, self.chains)]
        self.lookup.observe(ctx, verdict, gained, logits=logits, own=own, tree=self.verified)

    def forget(self) -> None:
        self.lookup.forget()

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
