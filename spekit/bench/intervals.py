"""How far a speedup could move on other questions of the same kinds: a paired bootstrap over the questions.

A bench answers a few questions per category (3 in the harness's recorded runs), and the speedup of a method
differs from one question to the next (a question whose answer repeats itself drafts well, one that does not
drafts little). Resampling the questions with replacement, each with its own `plain` answer beside it (paired:
the same prompts, the same machine moments in a lockstep run), and recomputing the speedup (total tokens over
total time, as the table computes it) gives an interval: with 90% of the resamples inside it, a figure such as
0.969x for one category of 3 questions can be read against it. It measures which questions were asked, not the
machine's drifts from second to second (lockstep and repeated runs are for those). Seeded, so a report repeats."""
from __future__ import annotations

import numpy as np

RESAMPLES = 2000
LEVEL = 0.90
SEED = 0


def speedup_interval(mine: list[dict], plain: list[dict]) -> list[float] | None:
    """[low, high] of the speedup of `mine` over `plain` (answer records of the same questions, answers.py), or
    None with fewer than two questions answered by both, or an untimed one."""
    by_id = {r["question_id"]: r for r in plain}
    pairs = [(r, by_id[r["question_id"]]) for r in mine if r["question_id"] in by_id]
    if len(pairs) < 2:
        return None
    table = np.array([[*_totals(m), *_totals(p)] for m, p in pairs], dtype=float)   # [Q, 4]: tokens, s; plain's
    if (table[:, [1, 3]] <= 0).any():
        return None
    picks = np.random.default_rng(SEED).integers(0, len(table), (RESAMPLES, len(table)))      # [R, Q]
    sums = table[picks].sum(axis=1)                                                             # [R, 4]
    ratio = (sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3])
    low, high = np.quantile(ratio, [(1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2])
    return [round(float(low), 3), round(float(high), 3)]


def _totals(record: dict) -> tuple[float, float]:
    """(new tokens, charged seconds) over all turns of one answer record."""
    return sum(record["choices"][0]["new_tokens"]), sum(record["spekit"]["charged_s"])
