"""Resting: a tree drafter's rows that have drafted nothing for a while rank their candidates in full only every few
steps, as many as keep that ranking's measured cost near OVERHEAD of a plain step (greedy steps only).

Ranking is Python work on the host, paid at every step whether or not a draft comes of it. Where a target's plain
step is long (PyTorch on a CPU, float32) a ranking is a percent of it and a row ranks at every step; where it is
short (a small GGUF model on llama.cpp) a ranking that drafts nothing costs several percent of every step, and a
method that has backed off would stay below plain by that much. A row resting still takes the cheap part of its
ranking (what the drafter's `full=False` leaves it); the first step after it drafts again ranks in full.

Under sampling a row ranks at every step: a draft decision there must not depend on the clock, or a seed would not
fix the output (greedy output never depends on drafts)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .base import StepContext

IDLE = 8            # rankings in a row that drafted nothing before a row may rest
OVERHEAD = 0.01     # the share of a plain step that resting rows' full rankings may cost, on average
LONGEST = 8         # the most steps between two full rankings of a resting row


@dataclass
class Idle:
    """One row's record: rankings in a row that drafted nothing, and steps since its last full ranking."""
    steps: int = 0
    since: int = 0


class Resting:
    """How often resting rows rank in full (`every`), from the measured time of full rankings."""

    def __init__(self) -> None:
        self.every = 1
        self._start = 0.0

    def full(self, rows: list[Idle], greedy: bool) -> list[bool]:
        """Per row, whether it ranks in full this step; starts the clock of this step's rankings."""
        out = []
        for row in rows:
            due = not greedy or row.steps < IDLE or row.since + 1 >= self.every
            row.since = 0 if due else row.since + 1
            out.append(due)
        self._start = time.perf_counter()
        return out

    def ranked(self, ctx: StepContext, full: list[bool]) -> None:
        """The rankings since `full` are done: how often to rank in full, so that a batch of resting rows spends
        about OVERHEAD of a plain step on it (greedy, where a plain step's seconds are measured)."""
        seconds = time.perf_counter() - self._start
        plain, count = ctx.budget.plain_s, sum(full)
        if not ctx.cfg.greedy or not plain or not count:
            return
        share = len(full) * seconds / count / plain        # every row's full ranking, in plain steps
        self.every = max(1, min(LONGEST, math.ceil(share / OVERHEAD)))

    @staticmethod
    def drafted(row: Idle, chosen: bool) -> None:
        row.steps = 0 if chosen else row.steps + 1
