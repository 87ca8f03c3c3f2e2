"""Draft sizing: the draft length or tree size that gives the most expected tokens per unit of cost, counting the
verification (`StepCosts.relative`, or the prior) and, where given, the drafter's own forwards; none where no size
beats a plain step by MARGIN (never slower than plain)."""
from __future__ import annotations

from typing import Callable

NODE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)   # tree sizes best_node_count weighs
MARGIN = 1.1   # a draft must promise 10% more tokens per unit of cost: step costs are noisy by about that much


def expected_gain(first: float, cont: float, k: int) -> float:
    """Tokens a step yields when the first of k drafted tokens is accepted with probability `first` and each later
    one, given the previous was, with probability `cont` (copy runs: once a copy starts it tends to go on):
    1 + first * (1 + cont + ... + cont^(k-1))."""
    if k == 0:
        return 1.0
    return 1.0 + first * sum(cont ** i for i in range(k))


def best_node_count(ranked: list[list], cost, scale: float = 1.0) -> int:
    """The node count m (0 = no draft) that gives these rows the most expected tokens per unit of cost: every row
    drafts its m most likely nodes (their chances times `scale`) and the forward pays for m + 1 tokens per row.
    ranked: per row, its candidate tree nodes (path, chance, anything), most likely first, parents before children
    (the tree drafters `rest` and `recycle`)."""
    longest = max((len(r) for r in ranked), default=0)
    best, best_rate = 0, float(len(ranked))
    cum = []
    for nodes in ranked:
        run, acc = [0.0], 0.0
        for _, p, _ in nodes:
            acc += p
            run.append(acc)
        cum.append(run)
    for m in sorted({w for w in NODE_COUNTS if w < longest} | {longest}):
        if m == 0:
            continue
        gain = sum(1.0 + scale * run[min(m, len(run) - 1)] for run in cum)
        rate = gain / cost(m + 1)
        if rate > best_rate * MARGIN:
            best, best_rate = m, rate
    return best


def best_widths(rows: list[tuple[Callable[[int], float], int]], cost, scale: float = 1.0) -> int:
    """The common draft width w (0 = no draft) that gives the batch the most tokens per unit of cost, the wider on
    ties; 0 unless it beats plain steps by MARGIN. rows: per row (accepted, longest draft it has), accepted(k) the
    draft tokens a chain of k is expected to keep (`pacing.odds`); every row drafts min(w, its longest), the forward
    pays for w + 1 tokens per row (shorter rows are padded); their expected tokens count times `scale`. cost(n):
    relative cost of n tokens per row. Widths are
    weighed against each other without the margin: it guards plain steps from noisy costs, and a wider draft that
    promises as much per unit of cost as a narrower one is no worse a bet."""
    longest = max((avail for _, avail in rows), default=0)
    best, best_rate = 0, 0.0
    for w in sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, longest}):
        if w > longest or w == 0:
            continue
        gain = sum(1.0 + scale * accepted(min(w, avail)) for accepted, avail in rows)
        rate = gain / cost(w + 1)
        if rate >= best_rate:
            best, best_rate = w, rate
    return best if best_rate > len(rows) * MARGIN else 0

