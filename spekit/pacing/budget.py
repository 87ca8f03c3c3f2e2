"""A step's budget: how deep each row may draft and what a draft costs, as the pacer sets them before the proposer
drafts (StepContext.budget). Proposers size their drafts with it and import nothing else of pacing."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, ClassVar

from .priors import prior_cost, smooth_prior_cost
from .sizing import MARGIN, best_node_count, best_widths
from .trees import TreePacing


@dataclass
class Budget:
    # per row: the deepest draft allowed: the context's end, or 0 on a step the governor holds speculation back
    # or whose row cannot bring a static batch's end nearer (`behind`)
    room: list[int]
    greedy: bool = True
    # cost of a target forward over n tokens per row / over one, for this batch (`StepCosts.relative`). Under sampling
    # it is the batch-independent prior, and proposers decide per row, so that a row's sample never depends on its batch
    cost: Callable[[int], float] = prior_cost
    # greedy only (None under sampling, where no decision may depend on the clock): the measured seconds of a plain
    # one-token step for this batch, and, filled in by the pacer's clock after `propose`, the seconds drafting took
    plain_s: float | None = None
    draft_s: float | None = None
    # sampling only: the prior cost table and each row's context length, so that each row's drafts are sized at its
    # own length (row_cost)
    prior: dict[int, float] | None = None
    lengths: list[int] | None = None
    # greedy static batches (Engine.generate): the rows whose progress decides when the batch ends, those with the
    # most tokens left to write; the others get no room to draft, and a batch drafts only what pays for these rows
    # (a token gained by a row that is ahead does not end the batch sooner). None: every row counts (one row,
    # sampling, a server's continuous batch, where each row's own progress matters)
    behind: list[int] | None = None
    # sampling: per row, the draft nodes another part of the same tree already holds (eagle3-lookup's lookup);
    # row_cost(b) is then what n more tokens cost on top of a forward over those, relative to that forward
    beneath: list[int] | None = None
    # a chain drafter's draft length per row (Proposer.chain_pacing), sized by the pacer; None for other drafters
    widths: list[int] | None = None
    # a tree drafter's rests, calibrated chances and drafting overhead (Proposer.paced_trees), kept by the pacer
    # between steps; None for other drafters
    trees: TreePacing | None = None
    # a chain drafter's tokens per row to read before it drafts (Proposer.unread), None where it reads nothing
    unread: list[int] | None = None
    # set False by a proposer whose drafting this step is no measure of what its drafts cost (a catch-up over
    # whole prompts): the pacer then leaves the step's time out of the drafting overhead it learns
    measured: bool = True

    margin: ClassVar[float] = MARGIN     # a draft must promise this many times a plain step's tokens per unit of cost

    def counted(self) -> list[int]:
        """The rows whose expected tokens a greedy batch's draft decision weighs (see `behind`)."""
        return list(range(len(self.room))) if self.behind is None else self.behind

    def row_cost(self, b: int) -> Callable[[int], float]:
        """Row b's cost of a forward over n tokens (relative to one). Greedy: the batch's measured `cost` (a greedy
        batch shares one width). Sampling: the prior at the row's own context length, which grows the cost of wide
        forwards over long prompts; never the cache's length, which counts other rows' padding, so a row's sample
        still depends on its own text only."""
        if self.greedy or self.prior is None:
            return self.cost
        context = self.lengths[b] if self.lengths else 0
        under = self.beneath[b] if self.beneath else 0
        if not under:
            return partial(prior_cost, table=self.prior, context=context)
        smooth = partial(smooth_prior_cost, table=self.prior, context=context)
        return lambda n: smooth(n + under) / smooth(1 + under)

    def spent(self) -> float | None:
        """The seconds this step's drafting took, in plain steps (greedy, once both are measured), else None."""
        return self.draft_s / self.plain_s if self.draft_s is not None and self.plain_s else None

    def chain_widths(self, rows: list[tuple[Callable[[int], float], int]], scale: float = 1.0) -> list[int]:
        """Each row's chain length (0 = no draft). rows: per row (accepted, longest draft it has), accepted(k) the
        draft tokens a chain of k is expected to keep, see `sizing.best_widths`. Greedy: one width for the batch,
        weighing the counted rows (their expected tokens times `scale`), each row drafting at most its longest;
        sampling: each row alone at its own cost."""
        if self.greedy:
            width = best_widths([rows[b] for b in self.counted()], self.cost, scale)
            return [min(width, avail) for _, avail in rows]
        return [best_widths([row], self.row_cost(b)) for b, row in enumerate(rows)]

    def node_counts(self, ranked: list[list], scale: float = 1.0) -> list[int]:
        """Each row's tree size (0 = no draft). ranked: per row its candidate nodes (path, chance, anything), most
        likely first, see `sizing.best_node_count`. Greedy: one size for the batch over the counted rows (chances
        times `scale`); sampling: each row alone at its own cost."""
        if self.greedy:
            return [best_node_count([ranked[b] for b in self.counted()], self.cost, scale)] * len(ranked)
        return [best_node_count([r], self.row_cost(b)) for b, r in enumerate(ranked)]
