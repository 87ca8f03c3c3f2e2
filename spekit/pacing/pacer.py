"""The pacer: the one object the engine asks about pacing, at two points of a step. Before the proposer drafts,
`budget` says how deep each row may draft and at what price (the governor's hold, a static batch's rows that
cannot bring its end nearer, the measured or prior step costs); after the step is decided and committed,
`settle` takes what the step cost (its clock) and what it returned (tokens) into the governor. The step's clock
(`StepClock`) is the pacer's too: it records each verification's cost in the target's `StepCosts`."""
from __future__ import annotations

import time
from functools import partial
from typing import Callable

from . import profiles
from .budget import Budget
from .chains import ChainPacer
from .governor import Governor
from .priors import bucket, prior_cost
from .step_costs import StepCosts
from .trees import TreePacing

# a static greedy batch drafts only while at most this many rows are furthest from their end (Budget.behind):
# with k rows tied there, a drafted step brings the batch's end nearer only if all k gain (at first-token
# acceptance p, about p^k of the time), while the wider forward costs every step
MOST_BEHIND = 2


class Pacer:
    """One per engine, over the target's shared `StepCosts`. speculates: the proposer offers drafts (else nothing
    is timed or governed); recording(): seconds spent recording CUDA graphs so far, whose time is no step cost."""

    def __init__(self, costs: StepCosts, speculates: bool, recording: Callable[[], float] = lambda: 0.0) -> None:
        self.costs, self.speculates, self.recording = costs, speculates, recording
        self.governor = Governor()        # greedy: holds speculation back while it is slower than plain steps
        # False: never held (measuring a drafter's acceptance, not speed; so with flat costs)
        self.governed = not costs.flat
        self.chain: ChainPacer | None = None   # a chain drafter's rows' pacing (`begin`), kept across generations
        self.draft_cost = 0.0                   # one draft forward relative to one target forward (`begin`)
        self.trees: TreePacing | None = None    # a tree drafter's rests, chances and overhead (`begin`)

    def begin(self, batch: int, greedy: bool, chain: tuple[int, int] | None, draft_cost: float,
              trees: bool = False) -> None:
        """A generation starts (after prefill). chain: for a chain drafter whose rows this pacer sizes, its
        starting draft length and ceiling (Proposer.chain_pacing), None otherwise; a greedy generation starts from
        what the last one learnt, a sampled one from the prior (so that a seed fixes the output). draft_cost: what
        the proposer declares one draft forward costs, relative to a target forward (Proposer.draft_cost). trees:
        the proposer's trees are paced here (Proposer.paced_trees, Budget.trees)."""
        self.chain = None if chain is None else ChainPacer.renew(self.chain, batch, *chain, greedy)
        self.draft_cost = draft_cost
        if trees:
            self.trees = self.trees or TreePacing()
            self.trees.begin(batch)

    def add_rows(self, count: int) -> None:
        """New rows join the running batch after its last row."""
        for pacing in (self.chain, self.trees):
            if pacing is not None:
                pacing.add_rows(count)

    def select_rows(self, rows: list[int]) -> None:
        """Finished rows left the batch: keep the pacing of these rows, in this order."""
        for pacing in (self.chain, self.trees):
            if pacing is not None:
                pacing.select_rows(rows)

    def budget(self, room: list[int], lengths: list[int], greedy: bool, context: int, step: bool = True,
               left: list[int] | None = None, remaining: list[int] | None = None,
               unread: list[int] | None = None) -> Budget:
        """Before proposing. room: per row the deepest draft its context allows; lengths: each row's tokens;
        context: keys in the target's cache (what a wide forward's new tokens attend to); step: for a decoding step
        (the governor may hold drafting back: every row then gets no room); left (greedy static batches): per row
        the tokens it has left to write, so that only the rows furthest from their end may draft; remaining: the
        same for any batch, and unread: the tokens each row's drafter must read before drafting (Proposer.unread),
        for a chain drafter's pacing (ChainPacer.widths)."""
        batch = len(room)
        if step and greedy and self.speculates and self.governed and not self.governor.allows():
            room = [0] * batch
        who = behind(left, room) if step and greedy and left is not None and batch > 1 else None
        if who is not None:
            tied = len(who) > MOST_BEHIND
            room = [r if b in who and not tied else 0 for b, r in enumerate(room)]
        if not greedy:    # under sampling a draft decision changes which random numbers are used: off the clock
            budget = Budget(room, False, partial(prior_cost, table=self.costs.prior), prior=self.costs.prior,
                            lengths=lengths)
        else:
            # the costs hold still until the step's forward is timed: each width is priced once a step (a tree
            # drafter weighs a dozen sizes, each of which looked through the measured contexts)
            budget = Budget(room, True, _priced_once(self.costs.relative, batch, context),
                            self.costs.plain_seconds(batch, context), lengths=lengths, behind=who)
        budget.trees, budget.unread = self.trees, unread
        if step and self.chain is not None:
            budget.widths = self.chain.widths(room, greedy, budget.cost, self.draft_cost,
                                              [budget.row_cost(b) for b in range(batch)], budget.counted(), unread,
                                              remaining)
        return budget

    def clock(self, budget: Budget, context: int) -> "StepClock":
        """The clock of one step, started now (before proposing), over a cache of `context` keys."""
        return StepClock(self, budget, context)

    def settle(self, clock: "StepClock", depths: list[int], drafted: bool, gained: list[list[int]],
               most_left: tuple[int, int]) -> None:
        """After deciding, committing and observing: what the step cost (its clock) and returned goes to the chain
        drafter's rows' pacing and to the governor (greedy speculation only). depths: each row's draft depth;
        drafted: the step verified draft or side nodes; gained: each row's new tokens; most_left: the most tokens
        a running row had left to write before and after the step (`progress`)."""
        budget = clock.budget
        if self.chain is not None:
            self.chain.observe(depths, gained, budget.spent() if budget.measured else None, self.draft_cost,
                               budget.unread)
        if not (budget.greedy and self.speculates):
            return
        batch = len(budget.room)
        # a batch's step that was let to draft counts as speculative even if it drafted nothing: deciding not to
        # (ranking the rows' candidates) is speculation's cost, and counted as plain it hid `rest`'s loss at 4+
        # rows in float32; one row keeps counting drafted steps only (there, holding cost more than it saved)
        tried = drafted or (batch > 1 and max(budget.room) > 0)
        tokens = progress(gained, *most_left, static=budget.behind is not None)
        self.governor.record(batch, tried, tokens, clock.seconds(),
                             self.costs.plain_seconds(batch, clock.context, nearest=False), clock.context)

    def calibrate(self, batch: int, context: int, greedy: bool, trial: Callable[[int], float],
                  warm_up: bool) -> None:
        """Time forwards over 1, 2, 4 and 8 tokens (trial(n): the seconds of one, rolled back) once per batch-size
        bucket, in the real context, so that the first drafts are sized with this model's costs, not a prior
        (Gemma's 262k-token head makes a multi-token forward far dearer than SmolLM2's). Only for greedy
        speculation (sampling sizes drafts with the prior) and a batch size not timed yet. warm_up: a shape's first
        forward compiles or captures it, which is not a cost to record."""
        if not (greedy and self.speculates) or bucket(batch) in self.costs.calibrated or self.costs.flat:
            return
        # a batch's forwards are dear and its drafts rarely pay: time one and two tokens per row only (wider
        # drafts use the prior until steps measure them); calibrating 1-8 at 24 rows cost 12% of a 64-token run
        # three of each: a median of fewer is not kept between runs (StepCosts.entries)
        widths = (1, 1, 1, 2, 2, 2, 4, 4, 4, 8, 8, 8) if batch == 1 else (1, 2, 2, 2)
        if warm_up:
            for n in sorted(set(widths)):
                trial(n)
        for n in widths:
            before = self.recording()
            seconds = trial(n)
            if self.recording() == before:          # (a trial that recorded a CUDA graph is no measure)
                self.costs.record(batch, n, seconds, context)
        self.costs.calibrated.add(bucket(batch))

    def save(self, force: bool = False) -> None:
        """Keep the measured costs between runs (`profiles.save`)."""
        profiles.save(self.costs, force)


class StepClock:
    """The clock of one step: drafting (from its start to `drafted`), verification (to `verified`) and observing
    (from `resume` to the pacer's `settle`); the time between (the consumer of the step's events) is not counted,
    nor time spent recording CUDA graphs, which is no measure of the replays to come."""

    def __init__(self, pacer: Pacer, budget: Budget, context: int) -> None:
        self.pacer, self.budget, self.context = pacer, budget, context
        self.t_draft, self.c_draft = time.perf_counter(), pacer.recording()
        self.draft_s = self.verify_s = self.recording_s = 0.0
        self.t_observe: float | None = None

    def drafted(self) -> None:
        """The proposer is done: what drafting took goes to the budget (greedy: StepContext.budget.spent)."""
        self.t_verify, self.c_verify = time.perf_counter(), self.pacer.recording()
        self.draft_s = self.t_verify - self.t_draft
        if self.budget.greedy:     # (the time a drafter spent recording a CUDA graph is not what drafting costs)
            self.budget.draft_s = self.draft_s - (self.c_verify - self.c_draft)

    def verified(self, width: int) -> None:
        """The target verified `width` tokens per row and the verdict is kept: the forward's seconds are recorded
        as this batch's cost of that width (unless the step recorded a CUDA graph)."""
        self.t_end, c_end = time.perf_counter(), self.pacer.recording()
        self.verify_s, self.recording_s = self.t_end - self.t_verify, c_end - self.c_draft
        if c_end == self.c_verify:
            self.pacer.costs.record(len(self.budget.room), width, self.verify_s, self.context)

    def resume(self) -> None:
        """The step's events are consumed: observing starts."""
        self.t_observe = time.perf_counter()

    def seconds(self) -> float:
        """The step's seconds so far: drafting, verification and observing, less CUDA graph recording."""
        observing = time.perf_counter() - self.t_observe if self.t_observe is not None else 0.0
        return (self.t_end - self.t_draft) + observing - (self.pacer.recording() - self.c_draft)


def _priced_once(relative, batch: int, context: int) -> Callable[[int], float]:
    """relative(batch, n, context=context) as a function of n, each n computed once (functools.cache costs more to
    make than a plain step that never prices anything saves)."""
    seen: dict[int, float] = {}

    def cost(n: int) -> float:
        if n not in seen:
            seen[n] = relative(batch, n, context=context)
        return seen[n]
    return cost


def behind(left: list[int], room: list[int]) -> list[int]:
    """The rows of a static greedy batch with the most tokens left to write (to max_new_tokens or the context's
    end): the batch ends when they do, so a token gained by a row ahead of them is worth nothing to its wall time
    (rows that drafted ahead would leave a slow row decoding alone at the end, one token per step at the cost of a
    whole batch's step). left: per row its tokens to max_new_tokens."""
    ahead = [min(n, r) for n, r in zip(left, room)]
    most = max(ahead)
    return [b for b, n in enumerate(ahead) if n >= most]


def progress(gained: list[list[int]], most_left_before: int, most_left_after: int, static: bool) -> int:
    """What a step brought the batch, in tokens, for the governor. A static batch ends when its slowest row does, so
    its step is worth the rows times how much nearer that row came (most_left_*: the most tokens a running row had
    left before and after the step; at most the most tokens a row gained: a row's stop token can end the batch
    sooner, for plain steps as for drafts), not the sum of tokens, which counted tokens that only took a row
    further ahead as won. Elsewhere (one row, a server's continuous batch) every token counts."""
    if not static:
        return sum(len(g) for g in gained)
    nearer = most_left_before - most_left_after
    return len(gained) * max(0, min(nearer, max(len(g) for g in gained)))
