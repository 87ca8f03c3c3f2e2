"""Measured step costs: the seconds of each verification step, kept as running medians by batch size, tree size and
context, and read as ratios to a one-token step (`StepCosts.relative`); a bucket not measured yet takes the prior
(`priors`). The engine records every step through its `Pacer`; `profiles` keeps the medians between runs."""
from __future__ import annotations

import statistics
from collections import deque

from .priors import CONTEXTS, PRIOR, UNIT_PRIOR, bucket, context_bucket, growth, prior_cost


# steps a wide bucket needs before its median counts (`record`): the first forward of a width can pay for
# allocations, and a figure too high is never measured again, as no draft is then made that wide
KEEP = 3
DOUBTFUL = 1.1      # a stored width costing this much more per token than a narrower one is measured again


class StepCosts:
    """Measured seconds per verification step by (batch-size bucket, tree-size bucket, context bucket): the median
    of the last `window` steps (once there are KEEP), so that a hiccup of a shared machine does not switch drafting off (or on) for long.
    Batch sizes share power-of-two buckets, so a server whose batch changes size every step calibrates a few times,
    not at every size (calibrating every new size would put a server's decoding below plain's).

    One per target (`Target.costs`): every engine over the same weights shares it. `stored` holds the medians of
    earlier runs on the same machine and model (`profiles`): they stand in for what this run has not measured yet,
    their ratios taken among themselves, so a run that starts from them needs no calibration forwards."""

    def __init__(self, window: int = 31, prior: dict[int, float] = PRIOR) -> None:
        self.prior = prior                      # the table used before a bucket is measured (see prior_for)
        self.recent: dict[tuple[int, int, int], deque] = {}
        self.seconds: dict[tuple[int, int, int], float] = {}
        self.stored: dict[tuple[int, int, int], float] = {}   # medians of earlier runs (a profile), same keys
        self.window = window
        self.calibrated: set[int] = set()       # batch-size buckets the engine has timed every tree bucket for
        self.profile: tuple | None = None       # (path, key) where spekit.pacing.profiles keeps these figures
        self.changed = False                    # measured anything since the profile was last written
        self.saved_at: float | None = None      # time.monotonic() of that write
        self.flat = False                       # `--cost-profile flat`: every width costs one step (see `make_flat`)

    def make_flat(self) -> None:
        """Price every forward as a one-token one, whatever is measured (greedy) and in the prior (sampling), so
        that drafters draft their widest: a drafter's acceptance on full trees, not this machine's trade-off."""
        self.flat, self.prior = True, UNIT_PRIOR

    def record(self, batch: int, nodes: int, seconds: float, context: int = 0) -> None:
        key = (bucket(batch), bucket(nodes), context_bucket(context))
        recent = self.recent.setdefault(key, deque(maxlen=self.window))
        recent.append(seconds)
        if len(recent) >= KEEP or key[1] == 1:      # (one-token steps come every step: no width goes unmeasured)
            self.seconds[key] = statistics.median(recent)
            self.changed = True

    def entries(self) -> list[list[float]]:
        """Every median known, this run's over the stored ones: [[batch bucket, tree bucket, context bucket,
        seconds], ...]."""
        merged = {**self.stored, **self.seconds}
        return [[*key, merged[key]] for key in sorted(merged)]

    def restore(self, entries: list, calibrated: list[int]) -> None:
        """Take an earlier run's medians (`entries`) as stored figures, and its calibrated batch buckets. A stored
        wide step that costs more per token than DOUBTFUL times the next narrower stored one at its batch and context
        is left out (a slow spell of the machine that outlived its run: a forward's cost grows at most in proportion
        to its tokens): this run prices it as if unmeasured until it measures it."""
        found = {}
        for bb, b, c, seconds in entries:
            key = (int(bb), int(b), int(c))
            if key == (bucket(key[0]), bucket(key[1]), context_bucket(key[2])) and float(seconds) > 0:
                found[key] = float(seconds)
        for (bb, b, c) in sorted(found, key=lambda k: (k[0], k[2], k[1])):      # narrower first
            seconds = found[(bb, b, c)]
            narrower = [a for (x, a, y) in self.stored if (x, y) == (bb, c) and a < b]
            if narrower and seconds / b > DOUBTFUL * self.stored[(bb, max(narrower), c)] / max(narrower):
                continue
            self.stored[(bb, b, c)] = seconds
        self.calibrated |= {int(bb) for bb in calibrated if any(k[0] == int(bb) for k in self.stored)}

    def plain_seconds(self, batch: int, context: int = 0, nearest: bool = True) -> float | None:
        """Measured seconds of a one-token step for this batch at this context (this run's, else a stored one);
        nearest: else at the nearest context bucket known (None when none is)."""
        here = (bucket(batch), 1, context_bucket(context))
        for table in (self.seconds, self.stored):
            if here in table:
                return table[here]
        if not nearest:
            return None
        near = self._nearest(bucket(batch), 1, context)
        return self._value((bucket(batch), 1, near)) if near else None

    def relative(self, batch: int, nodes: int, context: int = 0) -> float:
        """Cost of a step over `nodes` tokens per row relative to a one-token step, for this batch size at a context
        of `context` keys: measured at this context bucket, or the nearest one measured scaled by the prior's
        growth between the two, or the prior."""
        b = bucket(nodes)
        if b == 1 or self.flat:
            return 1.0
        bb, cb = bucket(batch), context_bucket(context)
        here = self._ratio(bb, b, cb)          # measured at this context bucket (most steps): no search
        if here is not None:
            return max(0.9, here)
        near = self._nearest(bb, b, context)
        if near is None:
            return prior_cost(nodes, batch, self.prior, context)
        ratio = max(0.9, self._ratio(bb, b, near))
        return 1.0 + (ratio - 1.0) * growth(self.prior, cb) / growth(self.prior, near)

    def _value(self, key: tuple[int, int, int]) -> float | None:
        return self.seconds.get(key, self.stored.get(key))

    def _ratio(self, bb: int, b: int, c: int) -> float | None:
        """Seconds of a `b`-token step over a one-token one at (bb, c), both from this run or both stored (a ratio
        of two runs would carry the machine's drift between them)."""
        for table in (self.seconds, self.stored):
            if (bb, b, c) in table and (bb, 1, c) in table:
                return table[(bb, b, c)] / table[(bb, 1, c)]
        return None

    def _nearest(self, bb: int, b: int, context: int) -> int | None:
        """The context bucket nearest to `context` (in doublings) where both one-token and `b`-token steps of
        batch bucket `bb` are known."""
        have = [c for c in CONTEXTS if self._ratio(bb, b, c) is not None]
        if not have:
            return None
        here = CONTEXTS.index(context_bucket(context))
        return min(have, key=lambda c: (abs(CONTEXTS.index(c) - here), c))
