"""Pacing of the tree drafters (EAGLE's head, Medusa's heads): rests after trees that did not pay, the calibration
of a head's chances against what the target accepts, and the drafting overhead measured by the clock. A greedy
batch keeps one of each (its rows share one tree size); under sampling each row keeps its own, so that a row's
sample does not depend on its batch."""
from __future__ import annotations

REST_MIN, REST_MAX = 4, 64
# Calibration of a head's path probabilities to greedy acceptance. A head trained on the target's soft
# distribution is underconfident about the target's argmax (p = 0.4 for a token the target picks greedily is
# common): acceptance can be several times the head's summed probabilities, and a fixed cal of 1 makes the tree look
# unprofitable, so the head rests nearly every step. The ratio of accepted draft tokens to summed path probabilities is learnt from
# the drafting steps (a prior of CAL_PRIOR tokens at ratio 1, a decay that forgets over ~20 steps).
CAL_PRIOR, CAL_DECAY, CAL_MAX = 0.5, 0.95, 4.0


class Rest:
    """Never slower than plain: when the best tree, its drafting cost counted, promised fewer tokens per unit of
    cost than a plain step (by the budget's margin), rest for a while (REST_MIN plain steps, twice as long after
    each failure, at most REST_MAX), then try again."""

    def __init__(self) -> None:
        self.left, self.length = 0, REST_MIN     # plain steps left to rest; the next rest's length

    def ready(self) -> bool:
        """Asked once a step: may the drafter draft now? (Resting, it spends one step of its rest.)"""
        if self.left:
            self.left -= 1
            return False
        return True

    def paid(self, pays: bool) -> None:
        """The verdict of a step's sizing: its best tree paid (the rests shorten again) or not (rest)."""
        if pays:
            self.length = REST_MIN
        else:
            self.left, self.length = self.length, min(2 * self.length, REST_MAX)


class TreePace(Rest):
    """A tree drafter's pacing (a greedy batch's, or one sampled row's): its rests, the calibration of its chances
    (`cal`: accepted draft tokens per unit of its summed path probabilities, from decayed sums) and the chance of
    its last verified tree (None: it verified none since the last `learn`)."""

    def __init__(self) -> None:
        super().__init__()
        self.got, self.scored, self.cal = 0.0, 0.0, 1.0
        self.chance: float | None = None

    def drafted(self, pays: bool, chance: float) -> None:
        """A sampled row's step: whether its chain paid, and its chance (0: it drafted none)."""
        self.chance = chance if chance > 0 else None
        self.paid(pays)

    def learn(self, got: int) -> None:
        """The verdict: `got` draft tokens of the last verified tree were accepted."""
        if self.chance is not None:
            self.got = CAL_DECAY * self.got + got
            self.scored = CAL_DECAY * self.scored + self.chance
            self.cal = min(CAL_MAX, max(1 / CAL_MAX, (self.got + CAL_PRIOR) / (self.scored + CAL_PRIOR)))
        self.chance = None


class DraftOverhead:
    """What drafting costs beyond its forwards' weights, learnt by the clock (greedy; Budget.spent, in plain steps):
    a catch-up's bookkeeping, the tree's, the lookups', and on a GPU the launches of a head's small kernels, which
    the weights' ratio (memory-bound forwards) does not see. Charged to every later tree. A generation's first
    drafting step is left out (`restart`): its catch-up reads the prompt."""

    decay = 0.8              # weight of the past

    def __init__(self) -> None:
        self.value, self.first = 0.0, True

    def restart(self) -> None:
        self.first = True

    def observe(self, spent: float | None, forwards: float | None) -> None:
        """spent: the step's drafting in plain steps (None: not measured); forwards: what its forwards cost by
        their weights, in plain steps (None: it fed no levels)."""
        first, self.first = self.first, False
        if spent is None or forwards is None or first:
            return
        self.value = self.decay * self.value + (1 - self.decay) * max(0.0, spent - forwards)


class TreePacing:
    """What the engine's pacer keeps for a tree drafter (Proposer.paced_trees; Budget.trees): the greedy batch's
    pacing (`batch`: one tree size for every row, kept across generations), each sampled row's (`rows`, from the
    prior at every generation) and drafting's overhead by the clock (`overhead`, kept across generations)."""

    def __init__(self) -> None:
        self.batch, self.rows, self.overhead = TreePace(), [], DraftOverhead()

    def begin(self, batch: int) -> None:
        self.batch.chance = None
        self.rows = [TreePace() for _ in range(batch)]
        self.overhead.restart()

    def add_rows(self, count: int) -> None:
        self.rows += [TreePace() for _ in range(count)]

    def select_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]
