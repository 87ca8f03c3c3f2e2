"""What a target forward over n new tokens per row costs relative to a forward over one, and the draft lengths
that pay best. Proposers use this to back off where speculation would not pay (never slower than plain).

The engine times every verification step and keeps a running median per batch size and tree-size bucket,
after timing each bucket once in the real context (calibration). Before a bucket has been seen, and always under
sampling (where a draft decision changes which random numbers are used, so it must not depend on the clock or on
the rest of the batch), the prior below is used: SmolLM2-135M on this 2-core CPU in float32 with `fastpath`,
by tokens in the forward (context 100-800: 2 tokens cost what 1 costs, 4 about 1.35x, 8 about 1.9x).
"""
from __future__ import annotations

import statistics
from collections import deque

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PRIOR = {1: 1.0, 2: 1.05, 4: 1.35, 8: 1.9, 16: 2.6, 32: 3.5, 64: 5.0, 128: 8.0, 256: 14.0, 512: 26.0,
         1024: 50.0}
MARGIN = 1.1   # a draft must promise 10% more tokens per unit of cost: step costs are noisy by about that much


def bucket(n: int) -> int:
    return next((b for b in BUCKETS if n <= b), BUCKETS[-1])


def prior_cost(nodes: int, batch: int = 1) -> float:
    """Prior cost of a step over `nodes` tokens per row for `batch` rows, relative to one token per row."""
    return PRIOR[bucket(batch * nodes)] / PRIOR[bucket(batch)]


class StepCosts:
    """Measured seconds per verification step by (batch-size bucket, tree-size bucket): the median of the last
    `window` steps, so that a hiccup of a shared machine does not switch drafting off (or on) for long. Batch
    sizes share power-of-two buckets, so a server whose batch changes size every step calibrates a few times, not
    at every size (measured: calibrating each new size made `ngram` serve 0.76x `plain` at 32 streams)."""

    def __init__(self, window: int = 31) -> None:
        self.recent: dict[tuple[int, int], deque] = {}
        self.seconds: dict[tuple[int, int], float] = {}
        self.window = window
        self.calibrated: set[int] = set()       # batch-size buckets the engine has timed every tree bucket for

    def record(self, batch: int, nodes: int, seconds: float) -> None:
        key = (bucket(batch), bucket(nodes))
        recent = self.recent.setdefault(key, deque(maxlen=self.window))
        recent.append(seconds)
        self.seconds[key] = statistics.median(recent)

    def relative(self, batch: int, nodes: int) -> float:
        """Cost of a step over `nodes` tokens per row relative to a one-token step, for this batch size."""
        b = bucket(nodes)
        if b == 1:
            return 1.0
        one, many = self.seconds.get((bucket(batch), 1)), self.seconds.get((bucket(batch), b))
        if one and many:
            return max(0.9, many / one)
        return prior_cost(nodes, batch)


def expected_gain(first: float, cont: float, k: int) -> float:
    """Tokens a step yields when the first of k drafted tokens is accepted with probability `first` and each later
    one, given the previous was, with probability `cont` (copy runs: once a copy starts it tends to go on):
    1 + first * (1 + cont + ... + cont^(k-1))."""
    if k == 0:
        return 1.0
    return 1.0 + first * sum(cont ** i for i in range(k))


def best_widths(rows: list[tuple[float, float, int]], cost) -> int:
    """The common draft width w (0 = no draft) that gives the batch the most tokens per unit of cost. rows: per
    row (first, cont, longest draft it has); every row drafts min(w, its longest), the forward pays for w + 1
    tokens per row (shorter rows are padded). cost(n): relative cost of n tokens per row."""
    longest = max((avail for _, _, avail in rows), default=0)
    best, best_rate = 0, float(len(rows))
    for w in sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, longest}):
        if w > longest:
            continue
        gain = sum(expected_gain(f, c, min(w, avail)) for f, c, avail in rows)
        rate = gain / cost(w + 1)
        if rate > best_rate * MARGIN:
            best, best_rate = w, rate
    return best
