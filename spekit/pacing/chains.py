"""Per-row pacing of the chain drafters (draft model, early exit, layer skip): each row's acceptance, its adaptive
ceiling and the drafting overhead measured by the clock."""
from __future__ import annotations

from .priors import bucket
from .sizing import MARGIN, expected_gain


class ChainPacer:
    """Per-row draft lengths for the chain drafters (draft model, early exit, layer skip): each row keeps decayed
    counts of draft tokens accepted and chains broken (its acceptance rate) and an adaptive ceiling k (all
    accepted: k += 2, else k -= 1); a row drafts the length that promises the most tokens per unit of cost,
    counting the verification (`cost`, relative to a plain step) and the drafter's own forwards (`step_cost` each),
    and none where no length beats a plain step by MARGIN. A row that does not draft drifts back to optimism, so
    it tries again when the text may have become easier (at a fixed pace: slowing it after failed drafts under
    sampling, as `jacobi` does, cut the shipped draft model's τ at temperature 0.7 from 1.11 to 1.06 and did not
    measurably pay). A drafter that must first read what was written while it paused (a draft model's catch-up,
    `unread` tokens) pays for that reading once, so the reading is spread over the steps the generation has left
    (`remaining` tokens at the draft's expected yield): a pause near a long prompt's start or near the end of an
    answer is then not ended by a probe that costs more than the rest of the answer could win. The decisions use
    only the rows' own history and the cost function given, so under sampling (prior costs) a seed still fixes the
    output."""

    prior = (2.0, 1.0)       # decayed counts: accepted / broken (mildly optimistic)
    overhead_decay = 0.8     # weight of the past in the measured overhead
    overhead_fade = 0.98     # per step without drafting: the overhead is forgotten, so the drafter tries again
    long_read = 2            # a catch-up over more than this many times the ceiling k is a reading (`feed`)

    def __init__(self, batch: int, start: int, top: int, prior: tuple[float, float] | None = None,
                 overhead: dict[int, float] | None = None, feed: dict[int, float] | None = None) -> None:
        """prior: the counts new rows start from (default: the class's; see `learned`); overhead, feed: measured
        drafting overheads and reading costs per token by batch bucket to start from (see `observe`)."""
        self.start, self.top = start, top
        self.prior = prior or ChainPacer.prior
        self.overhead = dict(overhead or {})
        self.feed = dict(feed or {})
        self.k, self.hits, self.offered = [], [], []
        self.observed: list[list[float] | None] = []   # per row: decayed counts from its drafts alone (no drift)
        self.add_rows(batch)

    @classmethod
    def renew(cls, last: "ChainPacer | None", batch: int, start: int, top: int, greedy: bool) -> "ChainPacer":
        """The pacer of a new generation: a greedy one starts from what `last` (the previous generation's pacer
        on the same proposer, if any) learnt; a sampled one from the class prior."""
        if last is None or not greedy:
            return cls(batch, start, top)
        return cls(batch, start, top, last.learned(), last.overhead, last.feed)

    def learned(self) -> tuple[float, float]:
        """Counts of the class prior's weight at the mean acceptance rate the rows' drafts showed (what this
        generation started from, if none drafted): a greedy generation on the same engine starts from what the last
        one learnt, instead of probing a drafter that rarely pays from scratch at every prompt (greedy output
        cannot depend on it; under sampling the class prior is always used, so that a seed fixes the output). The
        optimism drift of rows that did not draft is left out: it would carry a drafter that is rarely accepted into
        every next generation as a good one, which then drafts at a loss at each start."""
        seen = [h for h in self.observed if h is not None]
        if not seen:
            return self.prior
        rate = sum(ok / (ok + bad) for ok, bad in seen) / len(seen)
        weight = sum(ChainPacer.prior)
        return (weight * rate, weight * (1 - rate))

    def add_rows(self, count: int) -> None:
        self.k += [self.start] * count
        self.hits += [list(self.prior) for _ in range(count)]
        self.observed += [None] * count
        self.offered += [0] * count

    def widths(self, room: list[int], greedy: bool, cost, step_cost: float,
               row_costs: list | None = None, counted: list[int] | None = None, unread: list[int] | None = None,
               remaining: list[int] | None = None) -> list[int]:
        """Draft length per row, at most its k and its room. Greedy: one width for the batch (every row pays for
        the widest), weighing the gains of the rows `counted` (default all; Budget.counted), the drafting
        overhead measured at this batch size and the reading of `unread` tokens per row (Proposer.unread) at the
        measured cost per token, spread over the steps that `remaining` tokens per row take; under sampling each
        row alone, so that a row's sample does not depend on its batch (nor on the clock), with its own cost
        function (row_costs[b], Budget.row_cost) when given."""
        avail = [min(k, r) for k, r in zip(self.k, room)]
        alphas = [ok / (ok + bad) for ok, bad in self.hits]
        overhead = self.overhead.get(bucket(len(room)), 0.0) if greedy else 0.0
        feed = self.feed.get(bucket(len(room)), 0.0) if greedy and unread else 0.0

        def best(rows: list[int]) -> int:
            top, best_w, best_rate = max(avail[b] for b in rows), 0, float(len(rows))
            price = row_costs[rows[0]] if row_costs and len(rows) == 1 else cost
            reading = feed * max(unread[b] for b in rows) if feed else 0.0
            left = max(remaining[b] for b in rows) if remaining else 0
            for w in range(1, top + 1):
                gain = sum(expected_gain(alphas[b], alphas[b], min(w, avail[b])) for b in rows)
                steps = max(1.0, left * len(rows) / gain)        # what the rest of the generation takes, drafting
                rate = gain / (price(w + 1) + w * step_cost + overhead + reading / steps)
                if rate > best_rate * MARGIN:
                    best_w, best_rate = w, rate
            return best_w

        want = [min(best(counted or list(range(len(avail)))), a) for a in avail] if greedy else \
            [best([b]) for b in range(len(avail))]
        if overhead and not any(want):
            self.overhead[bucket(len(room))] = overhead * self.overhead_fade
        for b, w in enumerate(want):
            if w == 0:
                self.hits[b][0] += 0.05
        return want

    def observe(self, offered: list[int], gained: list[list[int]], spent: float | None = None,
                step_cost: float = 0.0, unread: list[int] | None = None) -> None:
        """The verdict of a step that offered these lengths. spent (greedy only): the seconds the proposer took to
        draft them, in plain-step units (Budget.spent: draft_s / plain_s): what it costs beyond `step_cost` per
        token (catching up on the committed tokens, bookkeeping) is kept per batch size and charged to every later
        draft of that size; where the drafter first read more than `long_read` times its ceiling of unread tokens
        (a prompt, or the text written during a pause), it is kept as a cost per token read (`feed`) instead."""
        if spent is not None and any(offered):
            key, extra = bucket(len(offered)), max(0.0, spent - max(offered) * step_cost)
            read = max(unread) if unread else 0
            kept, value = (self.feed, extra / read) if read > self.long_read * self.top else (self.overhead, extra)
            before = kept.get(key)
            kept[key] = value if before is None else self.overhead_decay * before + (1 - self.overhead_decay) * value
        self.offered = list(offered)
        for b, n in enumerate(offered):
            if not n:
                continue
            accepted = len(gained[b]) - 1
            if self.observed[b] is None:
                self.observed[b] = list(self.prior)
            for h in (self.hits[b], self.observed[b]):
                h[:] = [0.9 * x for x in h]
                h[0] += accepted
                h[1] += 1 if accepted < n else 0
            self.k[b] = min(self.top, self.k[b] + 2) if accepted == n else max(1, self.k[b] - 1)

    def select_rows(self, rows: list[int]) -> None:
        self.k = [self.k[r] for r in rows]
        self.hits = [self.hits[r] for r in rows]
        self.observed = [self.observed[r] for r in rows]
        self.offered = [self.offered[r] for r in rows]
