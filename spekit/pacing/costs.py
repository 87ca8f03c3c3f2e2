"""What a target forward over n new tokens per row costs relative to a forward over one, and the draft lengths
that pay best. Proposers use this to back off where speculation would not pay (never slower than plain).

The engine times every verification step and keeps a running median per batch size and tree-size bucket,
after timing each bucket once in the real context (calibration). Before a bucket has been seen, and always under
sampling (where a draft decision changes which random numbers are used, so it must not depend on the clock or on
the rest of the batch), a prior is used: SmolLM2-135M on this 2-core CPU in float32 with `fastpath`, by tokens
in the forward (context 100-800: 2 tokens cost what 1 costs, 4 about 1.35x, 8 about 1.9x); int4 / int8 layers
cost about the same
(int4: 1.1x, 1.24x, 1.8x). A bfloat16 target (no packed layers) on a CPU with native bf16 arithmetic (AVX-512 bf16
or AMX) is nearly flat up to 8 tokens (measured with `invariant`'s forms at a context of 200 / 1000: 4 tokens 1.0x
/ 1.13x, 8 tokens 1.13x / 1.27x, 16 tokens 1.36x / 1.79x), so it gets its own prior. Its 2 tokens are not free
(1.02x / 1.03x at a context of 128 / 384 on an AVX-512-bf16 EPYC, 1.05-1.13x from 640 to 1800 keys, medians of 25
forwards each): at 1.0x, sampled rows drafted one token whenever its acceptance passed 10%, and a Jacobi block that
is almost never accepted was tried on a fifth of the steps, 3-6% slower than plain over long prompts. On a CPU
without (AVX2 only) bfloat16 products are emulated and cost in proportion to their rows (measured at a context of
300: 2 tokens 1.12x, 4 tokens 2.06x, 8 tokens 3.6x, 16 tokens 6.0x), so it gets a steep one (`EMULATED_PRIOR`).

A wide forward also costs more, relative to a one-token one, the longer the context: the new tokens attend to every
cached key (in float64 under `invariant`'s forms). Measured on the same model and CPU, the extra cost of 8-32
tokens over one grew 1.5x at a 1024-token context, 2x at 2048 and 3x at 4096 in bfloat16 (float32: 1.6x at 4096).
So every figure is kept per context bucket too (powers of two from 512 keys), and a bucket not measured yet takes
the nearest measured one's ratio scaled by the prior growth between the two (`GROWTH`): a server that alternates
short and long prompts sizes each one's drafts with the costs of its own length, not with the other's.
"""
from __future__ import annotations

import statistics
from collections import deque

import torch

from ..backends.weight_quant import is_packed

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PRIOR = {1: 1.0, 2: 1.05, 4: 1.35, 8: 1.9, 16: 2.6, 32: 3.5, 64: 5.0, 128: 8.0, 256: 14.0, 512: 26.0,
         1024: 50.0}
FLAT_PRIOR = {1: 1.0, 2: 1.03, 4: 1.1, 8: 1.2, 16: 1.6, 32: 2.3, 64: 3.6, 128: 6.0, 256: 11.0, 512: 21.0,
              1024: 40.0}
# `--cost-profile flat`: a forward over any number of new tokens costs what one over a token does (what the papers'
# tree budgets assume, and about what a GPU does at batch 1): every drafter drafts the widest its options allow
UNIT_PRIOR = dict.fromkeys(BUCKETS, 1.0)
EMULATED_PRIOR = {1: 1.0, 2: 1.15, 4: 2.1, 8: 3.6, 16: 6.0, 32: 11.5, 64: 22.0, 128: 43.0, 256: 85.0, 512: 170.0,
                  1024: 340.0}
NODE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)   # tree sizes best_node_count weighs
MARGIN = 1.1   # a draft must promise 10% more tokens per unit of cost: step costs are noisy by about that much
CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)   # context buckets: keys in the cache
# how many times the extra cost of a wide forward (its cost over a one-token one's, minus 1) at a context bucket is
# that at up to 512 keys; beyond the measured 4096 it grows with the context, as attention comes to dominate
GROWTH = {id(PRIOR): dict(zip(CONTEXTS, (1.0, 1.0, 1.1, 1.6, 2.5, 4.5, 8.5, 16.5, 32.5))),
          id(FLAT_PRIOR): dict(zip(CONTEXTS, (1.0, 1.5, 2.0, 3.0, 5.0, 9.0, 17.0, 33.0, 65.0))),
          id(EMULATED_PRIOR): dict(zip(CONTEXTS, (1.0, 1.0, 1.1, 1.6, 2.5, 4.5, 8.5, 16.5, 32.5)))}


def bucket(n: int) -> int:
    return next((b for b in BUCKETS if n <= b), BUCKETS[-1])


def context_bucket(keys: int) -> int:
    return next((c for c in CONTEXTS if keys <= c), CONTEXTS[-1])


def growth(table: dict[int, float], context: int) -> float:
    """GROWTH of `table` at a context of `context` keys (1.0 for a table it does not know)."""
    return GROWTH.get(id(table), {}).get(context_bucket(context), 1.0)


def prior_cost(nodes: int, batch: int = 1, table: dict[int, float] = PRIOR, context: int = 0) -> float:
    """Prior cost of a step over `nodes` tokens per row for `batch` rows, relative to one token per row, at a
    context of `context` keys (0: a short one)."""
    return 1.0 + (table[bucket(batch * nodes)] / table[bucket(batch)] - 1.0) * growth(table, context)


def smooth_prior_cost(nodes: int, table: dict[int, float] = PRIOR, context: int = 0) -> float:
    """prior_cost for one row, read between the table's power-of-two points (linearly) instead of rounded up to
    the next: where a part of a tree is already paid for (StepContext.beneath), a few more nodes cost their share
    of the step to the next point, not the whole step (measured, eagle3-lookup at temperature 0.7: emulated
    bfloat16 1.008x plain against 0.998x rounded up, float32 1.12x against 1.10x, in one run each)."""
    hi = bucket(nodes)
    lo = max((b for b in BUCKETS if b < nodes), default=1)
    a, b = prior_cost(lo, table=table, context=context), prior_cost(hi, table=table, context=context)
    return a if hi == lo else a + (b - a) * (nodes - lo) / (hi - lo)


def prior_for(model) -> dict[int, float]:
    """The prior table for a target model: for bfloat16 / float16 weights without packed layers FLAT_PRIOR, or on
    a CPU without native arithmetic for that type EMULATED_PRIOR; else PRIOR."""
    param = next(model.parameters())
    if param.dtype not in (torch.bfloat16, torch.float16) or is_packed(model):
        return PRIOR
    return FLAT_PRIOR if param.device.type != "cpu" or native_half(param.dtype) else EMULATED_PRIOR


HALF_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16"), torch.float16: ("avx512_fp16", "amx_fp16", "fphp")}


def native_half(dtype: torch.dtype, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies `dtype` natively (its flags in /proc/cpuinfo: AVX-512 bf16 / fp16, AMX, Arm's
    bf16 / fphp); False where that cannot be read."""
    try:
        with open(cpuinfo) as f:
            flags = {word for line in f if line.startswith(("flags", "Features")) for word in line.split()}
    except OSError:
        return False
    return any(flag in flags for flag in HALF_FLAGS[dtype])


class StepCosts:
    """Measured seconds per verification step by (batch-size bucket, tree-size bucket, context bucket): the median
    of the last `window` steps, so that a hiccup of a shared machine does not switch drafting off (or on) for long.
    Batch sizes share power-of-two buckets, so a server whose batch changes size every step calibrates a few times,
    not at every size (measured: calibrating each new size made `ngram` serve 0.76x `plain` at 32 streams).

    One per target (`Target.costs`): every engine over the same weights shares it. `stored` holds the medians of
    earlier runs on the same machine and model (`spekit.pacing.profiles`): they stand in for what this run has not measured
    yet, their ratios taken among themselves, so a run that starts from them needs no calibration forwards."""

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
        self.seconds[key] = statistics.median(recent)
        self.changed = True

    def entries(self) -> list[list[float]]:
        """Every median known, this run's over the stored ones: [[batch bucket, tree bucket, context bucket,
        seconds], ...]."""
        merged = {**self.stored, **self.seconds}
        return [[*key, merged[key]] for key in sorted(merged)]

    def restore(self, entries: list, calibrated: list[int]) -> None:
        """Take an earlier run's medians (`entries`) as stored figures, and its calibrated batch buckets."""
        for bb, b, c, seconds in entries:
            key = (int(bb), int(b), int(c))
            if key == (bucket(key[0]), bucket(key[1]), context_bucket(key[2])) and float(seconds) > 0:
                self.stored[key] = float(seconds)
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
        near = self._nearest(bb, b, context)
        if near is None:
            return prior_cost(nodes, batch, self.prior, context)
        ratio = max(0.9, self._ratio(bb, b, near))
        if near == cb:
            return ratio
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


def expected_gain(first: float, cont: float, k: int) -> float:
    """Tokens a step yields when the first of k drafted tokens is accepted with probability `first` and each later
    one, given the previous was, with probability `cont` (copy runs: once a copy starts it tends to go on):
    1 + first * (1 + cont + ... + cont^(k-1))."""
    if k == 0:
        return 1.0
    return 1.0 + first * sum(cont ** i for i in range(k))


def best_chain(nodes: list) -> list:
    """Ranked tree nodes (path, chance, anything; most likely first, parents before children) cut to one chain:
    the likeliest first node, then its likeliest child, and so on. For a target that verifies one chain per row
    (StepContext.chains_only), where the other branches would be dropped before verification."""
    out, end = [], ()
    while True:
        node = next((x for x in nodes if len(x[0]) == len(end) + 1 and x[0][:-1] == end), None)
        if node is None:
            return out
        out.append(node)
        end = node[0]


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


def slowed_drift(current: float, base: float, accepted: int) -> float:
    """A sampled row's pace of drifting back to drafting after it drafted (`jacobi`): `base` again once a token was
    accepted, else half of `current`, down to an eighth of `base` (under sampling no timed guard holds failing drafts
    back)."""
    return base if accepted else max(current / 2, base / 8)


class ChainPacer:
    """Per-row draft lengths for the chain drafters (draft model, early exit, layer skip): each row keeps decayed
    counts of draft tokens accepted and chains broken (its acceptance rate) and an adaptive ceiling k (all
    accepted: k += 2, else k -= 1); a row drafts the length that promises the most tokens per unit of cost,
    counting the verification (`cost`, relative to a plain step) and the drafter's own forwards (`step_cost` each),
    and none where no length beats a plain step by MARGIN. A row that does not draft drifts back to optimism, so
    it tries again when the text may have become easier (at a fixed pace: slowing it after failed drafts under
    sampling, as `jacobi` does, cut the shipped draft model's τ at temperature 0.7 from 1.11 to 1.06 and did not
    measurably pay). The decisions use only the rows' own history and the cost function given, so under sampling
    (prior costs) a seed still fixes the output."""

    prior = (2.0, 1.0)       # decayed counts: accepted / broken (mildly optimistic)
    overhead_decay = 0.8     # weight of the past in the measured overhead
    overhead_fade = 0.98     # per step without drafting: the overhead is forgotten, so the drafter tries again

    def __init__(self, batch: int, start: int, top: int, prior: tuple[float, float] | None = None,
                 overhead: dict[int, float] | None = None) -> None:
        """prior: the counts new rows start from (default: the class's; see `learned`); overhead: measured
        drafting overheads by batch bucket to start from (see `observe`)."""
        self.start, self.top = start, top
        self.prior = prior or ChainPacer.prior
        self.overhead = dict(overhead or {})
        self.k, self.hits, self.offered = [], [], []
        self.observed: list[list[float] | None] = []   # per row: decayed counts from its drafts alone (no drift)
        self.add_rows(batch)

    @classmethod
    def renew(cls, last: "ChainPacer | None", batch: int, start: int, top: int, greedy: bool) -> "ChainPacer":
        """The pacer of a new generation: a greedy one starts from what `last` (the previous generation's pacer
        on the same proposer, if any) learnt; a sampled one from the class prior."""
        if last is None or not greedy:
            return cls(batch, start, top)
        return cls(batch, start, top, last.learned(), last.overhead)

    def learned(self) -> tuple[float, float]:
        """Counts of the class prior's weight at the mean acceptance rate the rows' drafts showed (what this
        generation started from, if none drafted): a greedy generation on the same engine starts from what the last
        one learnt, instead of probing a drafter that rarely pays from scratch at every prompt (greedy output
        cannot depend on it; under sampling the class prior is always used, so that a seed fixes the output). The
        optimism drift of rows that did not draft is left out: it carried a drafter accepted 10-25% of the time
        into every next generation at an estimated 0.7 (measured, batch 4), which drafted at a loss at each start."""
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
               row_costs: list | None = None, counted: list[int] | None = None) -> list[int]:
        """Draft length per row, at most its k and its room. Greedy: one width for the batch (every row pays for
        the widest), weighing the gains of the rows `counted` (default all; StepContext.counted) and the drafting
        overhead measured at this batch size; under sampling each row alone,
        so that a row's sample does not depend on its batch (nor on the clock), with its own cost function
        (row_costs[b], StepContext.row_cost) when given."""
        avail = [min(k, r) for k, r in zip(self.k, room)]
        alphas = [ok / (ok + bad) for ok, bad in self.hits]
        overhead = self.overhead.get(bucket(len(room)), 0.0) if greedy else 0.0

        def best(rows: list[int]) -> int:
            top, best_w, best_rate = max(avail[b] for b in rows), 0, float(len(rows))
            price = row_costs[rows[0]] if row_costs and len(rows) == 1 else cost
            for w in range(1, top + 1):
                gain = sum(expected_gain(alphas[b], alphas[b], min(w, avail[b])) for b in rows)
                rate = gain / (price(w + 1) + w * step_cost + overhead)
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
                step_cost: float = 0.0) -> None:
        """The verdict of a step that offered these lengths. spent (greedy only): the seconds the proposer took to
        draft them, in plain-step units (StepContext.draft_s / plain_s): what it costs beyond `step_cost` per
        token (catching up on the committed tokens, bookkeeping; measured for the shipped draft model at batch 4:
        0.05-0.15 plain steps a draft step) is kept per batch size and charged to every later draft of that size."""
        if spent is not None and any(offered):
            key, extra = bucket(len(offered)), max(0.0, spent - max(offered) * step_cost)
            before = self.overhead.get(key)
            self.overhead[key] = extra if before is None else \
                self.overhead_decay * before + (1 - self.overhead_decay) * extra
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


class Governor:
    """Never slower than plain, measured end to end (greedy decoding only): the engine times every step, and while
    the speculative steps of this batch size yield fewer tokens per second than its plain steps do at the same
    context bucket (a step over 4096 keys is slower than one over 256 whatever it drafts), it holds
    speculation back (every row gets no room to draft) for `hold` steps, twice as long after each failure (16 to
    256 steps), then lets the proposer try again. A batch (2+ rows) is also held at once, inside a window, when
    the window's speculative steps have cost `most_lost` plain steps more than plain steps would have taken for
    their tokens: a wide batch forward that fails costs a whole plain step, and eight of them before a verdict
    cost more than the batch's drafts won. One row waits for a bigger loss (`most_lost_one` plain steps): there a
    wide tree that fails costs as much, but the next may win several tokens; yet where a step's drafting costs
    several plain steps (on an H200, whose host launches each of a drafter's small kernels in about 40 us, an
    EAGLE-3 step drafted for 31 ms against a 7 ms plain step), eight steps before a verdict lost more than the
    whole answer's drafts could win (0.42x plain). The proposers' own pacing decides what to draft; this
    catches what their cost models miss (a draft model slower than its weights suggest, bookkeeping, batches).
    Under sampling it stays off: a draft decision there must not depend on the clock, or a seed would not fix
    the output.
    """

    decay, window, first_hold, longest_hold, most_lost, most_lost_one = 0.9, 8, 16, 256, 2.0, 4.0

    def __init__(self) -> None:
        # (batch bucket, context bucket) -> decayed [tokens, seconds, steps, seconds lost] when drafting /
        # [tokens, seconds] plain
        self.spec: dict[tuple[int, int], list[float]] = {}
        self.plain: dict[tuple[int, int], list[float]] = {}
        self.held, self.hold = 0, self.first_hold

    def allows(self) -> bool:
        """Whether this step may speculate (counts a held step down)."""
        if self.held > 0:
            self.held -= 1
            return False
        return True

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float, plain_guess: float | None,
               context: int = 0) -> None:
        """One step of `batch` rows over a cache of `context` keys: whether any row drafted, the tokens it
        committed and its seconds. plain_guess: seconds of a plain step for this batch at this context bucket when
        none has been timed yet (a one-token forward)."""
        key = (bucket(batch), context_bucket(context))
        if not drafted:
            t = self.plain.setdefault(key, [0.0, 0.0])
            t[0], t[1] = self.decay * t[0] + tokens, self.decay * t[1] + seconds
            return
        s = self.spec.setdefault(key, [0.0, 0.0, 0.0, 0.0])
        s[0], s[1], s[2] = self.decay * s[0] + tokens, self.decay * s[1] + seconds, s[2] + 1
        t = self.plain.get(key)
        plain_rate = t[0] / t[1] if t and t[1] > 0 else (batch / plain_guess if plain_guess else None)
        if plain_rate is None:
            return
        s[3] += seconds - tokens / plain_rate                   # seconds lost against plain steps (< 0: won)
        lost = s[3] > (self.most_lost if batch > 1 else self.most_lost_one) * batch / plain_rate
        if s[2] < self.window and not lost:
            return
        if lost or s[0] / s[1] < plain_rate:
            self.held, self.hold = self.hold, min(2 * self.hold, self.longest_hold)
        else:
            self.hold = self.first_hold
        self.spec[key] = [0.0, 0.0, 0.0, 0.0]
