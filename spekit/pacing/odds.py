"""A row's odds of having its chain draft accepted, as the lookup and guessing drafters (`ngram`, `jacobi`) learn
them: decayed counts of the first draft token accepted or rejected, and of each later one accepted or rejected given
the one before was (copy runs: once a copy starts it tends to go on). `Budget.chain_widths` sizes drafts from the two
rates; a row that does not draft drifts back towards optimism at its own pace, so it tries again when the text may
have become predictable."""
from __future__ import annotations

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

    def learn(self, accepted: int, offered: int) -> None:
        """A verdict: `accepted` of the `offered` draft tokens were accepted."""
        h = self.counts
        h[:] = [DECAY * x for x in h]
        h[0 if accepted else 1] += 1
        if accepted:
            h[2] += accepted - 1
            h[3] += 1 if accepted < offered else 0

    def judge(self, right: bool, continued: bool) -> None:
        """A guess that was not drafted, judged by the token the step committed (`right`): the first-token counts
        move as a drafted token's would; `continued`: the guess before it was right too, so it counts as a later
        token of a copy run."""
        h = self.counts
        h[:] = [DECAY * x for x in h]
        h[0 if right else 1] += 1
        if continued:
            h[2 if right else 3] += 1

    def drift(self) -> None:
        """A step the row did not draft: back towards optimism, the text may turn predictable."""
        self.counts[0] += self.pace

    def slow(self, base: float, accepted: int) -> None:
        """Under sampling, after a draft (no timed guard holds failing drafts back there): the pace is `base` again
        once a token was accepted, else half of what it was, down to an eighth of `base`."""
        self.pace = base if accepted else max(self.pace / 2, base / 8)
