"""Continuous batching over one engine: rows join a running batch at step boundaries and leave it when they finish
or are cancelled, so a server decodes all its concurrent requests in one batch.

    session = Session(engine, cfg)
    rows = session.add([prompt_ids], cfg)      # queued; prefilled and merged into the batch by the next step
    while session.busy:
        for event in session.step():           # one verification step for every live row (consume it whole)
            ...
    session.cancel(row)                        # the row leaves at the next step boundary

Newcomers are prefilled together in a cache of their own, get their first token, and their cache is merged into
the running one (`KVState.merge`: the shorter side gets holes in front); the proposer takes them on through
`add_rows`. A proposer without `add_rows` still works: newcomers then wait until the running batch has drained.

One forward serves rows of one method and one set of sampling settings (`batch_key`: temperature, top-k, top-p,
min-p, penalties, logit bias); each row keeps its own max_new_tokens, stop ids, seed, sample index, log-probability
settings and grammar (json_schema, regex), so a row's output is the one `Engine.generate` gives for its prompt alone
(greedy: token for token; sampled: the same sample for the same seed, since each row draws from its own generator
seeded by `row_seed`).
Draft widths under greedy adapt to the batch size as it changes: the engine times each new batch size once
(`_calibrate`) and keeps measuring every step. Not thread-safe: one thread calls add, cancel and step.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Iterator

from .config import SamplingConfig
from .engine import Engine, Event, _Row, row_seed
from .sampling import make_generators


def batch_key(cfg: SamplingConfig) -> SamplingConfig:
    """The settings rows must share to be verified in one forward (the per-row ones reset)."""
    return dataclasses.replace(cfg, max_new_tokens=SamplingConfig.max_new_tokens, stop_ids=(), seed=0, n=1,
                               min_new_tokens=0,
                               logprobs=False, top_logprobs=0, json_schema="", regex="")


class Session:
    def __init__(self, engine: Engine, cfg: SamplingConfig):
        self.engine, self.cfg = engine, batch_key(cfg)
        self.rows: dict[int, _Row] = {}
        self.live: list[int] = []              # rows in the running batch, in cache order
        self.waiting: list[int] = []           # added, not prefilled yet
        self.kv = None
        self.gens: list | None = None if self.cfg.greedy else []
        self._ids = itertools.count()
        self.joins = engine.proposer.can_add_rows()

    @property
    def busy(self) -> bool:
        return bool(self.live or self.waiting)

    @property
    def size(self) -> int:
        """Rows running or waiting."""
        return len(self.live) + len(self.waiting)

    def add(self, prompts: list[list[int]], cfg: SamplingConfig) -> list[int]:
        """Queue `cfg.n` samples of each prompt; returns their row ids in (prompt, sample) order. Bad prompts raise
        UserError here, before anything is queued."""
        if batch_key(cfg) != self.cfg:
            raise ValueError("a session decodes rows of one batch_key only")
        now = time.perf_counter()
        ids = []
        for row in self.engine._rows(prompts, cfg):
            row.cfg, row.t0 = cfg, now
            ids.append(next(self._ids))
            self.rows[ids[-1]] = row
        self.waiting += ids
        return ids

    def cancel(self, row: int) -> None:
        """The row leaves (at the next step if it is running); its stats so far stay on its _Row until then."""
        if row in self.waiting:
            self.waiting.remove(row)
            self.rows.pop(row)
        elif row in self.rows:
            self.rows[row].finish = self.rows[row].finish or "cancelled"

    def step(self) -> Iterator[Event]:
        """Admit waiting rows (prefill, first token), then one verification step over the batch; events as they
        come (newcomers' first tokens before the batch's step). Consume it whole before the next call."""
        self._leave()
        if self.waiting and (self.joins or not self.live):
            yield from self._admit()
        if self.live:
            e = self.engine
            ctx = e._context(self.rows, self.live, self.kv, self.cfg, self.gens, step=True, static=False)
            yield from e._one_step(self.rows, self.live, self.kv, ctx, self.cfg, self.gens, 0.0)
        self._leave()
        self.engine.pacer.save()               # at most every few seconds

    def _admit(self) -> Iterator[Event]:
        e, new = self.engine, self.waiting
        self.waiting = []
        gens = None if self.cfg.greedy else make_generators(
            [row_seed(self.rows[r].cfg.seed, self.rows[r]) for r in new], e.target.device)
        kv, hidden, gens, events = e._prefill(self.rows, new, self.cfg, gens, time.perf_counter())
        for ev in events:
            if ev.finish is not None:
                self.rows.pop(ev.row)
        yield from events                      # first tokens out before calibration and merging
        if not new:
            kv.release()
            return
        ctx = e._context(self.rows, new, kv, self.cfg, gens)
        if not self.live:
            self.kv, self.live, self.gens = kv, new, gens
            e._calibrate(kv, ctx)
            e._begin(ctx, hidden)
            return
        self.kv.merge(kv)                      # (a copy: the newcomers' own cache is done with)
        kv.release()
        self.live += new
        if gens is not None:
            self.gens += gens
        e.proposer.add_rows(ctx, hidden)
        e.pacer.add_rows(len(new))
        e._calibrate(self.kv, e._context(self.rows, self.live, self.kv, self.cfg, self.gens))

    def _leave(self) -> None:
        """Finished and cancelled rows leave the batch; an empty batch lets go of its cache."""
        before = list(self.live)
        self.gens = self.engine._drop_finished(self.rows, self.live, self.kv, self.gens, begun=True)
        for row in set(before) - set(self.live):
            self.rows.pop(row)
        if not self.live:
            if self.kv is not None:
                self.kv.release()
            self.kv, self.gens = None, None if self.cfg.greedy else []
