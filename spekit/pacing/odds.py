"""A row's odds of having its chain draft accepted, as the lookup and guessing drafters learn them.

ChainOdds (`jacobi`): decayed counts of the first draft token accepted or rejected, and of each later one accepted
or rejected given the one before was (copy runs: once a copy starts it tends to go on); a row that does not draft
drifts back towards optimism at its own pace, so it tries again when the text may have become predictable.

RunOdds (`ngram`): per draft position i, decayed counts of a copy that reached position i going on past it or
stopping there. A copy's run is bimodal (it ends at once, or a loop goes on for dozens of tokens), which a two-rate
chain model flattens into drafts too short; counted per position, the expected run for every width follows.

`Budget.chain_widths` sizes drafts from either's `accepted(k)`: the draft tokens a chain of k is expected to keep."""
from __future__ import annotations

from .sizing import expected_gain

DECAY = 0.9        # weight of the past at each verdict


class ChainOdds:
    """counts: [first accepted, first rejected, later accepted, later rejected]; pace: what the first-accepted count
    gains per step the row does not draft (`drift`)."""

    __slots__ = ("counts", "pace")

    def __init__(self, counts: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0), pace: float = 0.0) -> None:
        self.counts, self.pace = list(counts), pace

    def rates(self) -> tuple[float, float]:
        """(first token's acceptance, a later token's given the one before it was accepted)."""
        f, fb, c, cb = self.counts
        return f / (f + fb), c / (c + cb)

    def accepted(self, k: int) -> float:
        """Draft tokens a chain of k keeps, expected: first * (1 + cont + ... + cont^(k-1))."""
        first, cont = self.rates()
        return expected_gain(first, cont, k) - 1.0

    def learn(self, accepted: int, offered: int) -> None:
        """A verdict: `accepted` of the `offered` draft tokens were accepted."""
        h = self.counts
        h[:] = [DECAY * x for x in h]
        h[0 if accepted else 1] += 1
        if accepted:
            h[2] += accepted - 1
            h[3] += 1 if accepted < offered else 0

    def drift(self) -> None:
        """A step the row did not draft: back towards optimism, the text may turn predictable."""
        self.counts[0] += self.pace

    def slow(self, base: float, accepted: int) -> None:
        """Under sampling, after a draft (no timed guard holds failing drafts back there): the pace is `base` again
        once a token was accepted, else half of what it was, down to an eighth of `base`."""
        self.pace = base if accepted else max(self.pace / 2, base / 8)


class RunOdds:
    """Per draft position i < depth: [went on past i, stopped at i], decayed by `decay` at each new copy counted
    (`start`), so that the estimates follow the text (a loop starting, a list ending). prior: the counts a fresh
    estimate starts from at every position."""

    __slots__ = ("on", "stop", "decay")

    def __init__(self, depth: int, prior: tuple[float, float] = (1.0, 1.0), decay: float = 0.7) -> None:
        self.on, self.stop, self.decay = [prior[0]] * depth, [prior[1]] * depth, decay

    def start(self) -> None:
        """A new copy is counted from now on: the past weighs less."""
        self.on = [self.decay * x for x in self.on]
        self.stop = [self.decay * x for x in self.stop]

    def went_on(self, i: int) -> None:
        """A copy's token at position i was right."""
        if i < len(self.on):
            self.on[i] += 1.0

    def stopped(self, i: int) -> None:
        """A copy's token at position i was wrong: the copy ended there."""
        if i < len(self.stop):
            self.stop[i] += 1.0

    def learn(self, accepted: int, offered: int) -> None:
        """A drafted chain's verdict, where nothing else tells how its copy went on: `accepted` of `offered`."""
        self.start()
        for i in range(accepted):
            self.went_on(i)
        if accepted < offered:
            self.stopped(accepted)

    def accepted(self, k: int) -> float:
        """Draft tokens a chain of k keeps, expected: the sum over i < k of the chance to get past position i."""
        kept, alive = 0.0, 1.0
        for i in range(min(k, len(self.on))):
            alive *= self.on[i] / (self.on[i] + self.stop[i])
            kept += alive
        return kept
