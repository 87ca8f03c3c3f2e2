"""The worker thread: all concurrent requests decode through `Session`s, one per lane (method, its options and the
sampling settings rows must share in one forward). New requests join their lane's running batch at the next step
boundary, up to `max_batch_size` rows in all lanes together; a request that does not fit yet waits in FIFO order.
Lanes with work take one step each in turn. Finished and cancelled rows leave at step boundaries.

The HTTP side (asyncio) talks to the worker through a thread-safe inbox; the worker hands each job its events
through the job's asyncio queue (`call_soon_threadsafe`)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..api import Spekit
from ..methods import build_engine, method_options, resolve_method
from ..config import SamplingConfig, UserError
from ..engine import Engine
from ..logprobs import of_text
from ..proposers import get as get_method
from ..batching import Session, batch_key
from .metrics import BATCH_BUCKETS, Metrics

log = logging.getLogger("spekit.server")
IDLE_LANES = 8           # sessions kept around without work


@dataclass(frozen=True)
class Lane:
    method: str
    options: tuple            # sorted (name, value) pairs of the method's options
    sampling: SamplingConfig  # batch_key of the request's settings
    lossless: bool = True     # its answers are the target's own (not with an opt-in lossy rule: Proposer.keeps_law)


@dataclass(frozen=True)
class Item:
    """What a job receives: a choice's new tokens and its finish reason (None while running); or an error."""
    choice: int
    tokens: list[int]
    finish: str | None = None
    error: Exception | None = None
    logprobs: list | None = None     # TokenLogprob per token, when the request asked for them
    forwards: int | None = None      # the target forwards the choice's answer took so far (its total on the last item)


@dataclass(eq=False)
class Job:
    lane: Lane
    prompts: list[list[int]]
    cfg: SamplingConfig
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrived: float = field(default_factory=time.perf_counter)
    rows: list[int] = field(default_factory=list)      # session row ids, in choice order (prompt, sample)
    open: set[int] = field(default_factory=set)        # choices still running

    @property
    def size(self) -> int:
        return len(self.prompts) * self.cfg.n

    def put(self, item: Item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Scheduler:
    def __init__(self, sk: Spekit, method: str, options: dict, max_batch_size: int, metrics: Metrics):
        self.sk, self.max_batch_size, self.metrics = sk, max_batch_size, metrics
        self.default = (method, options)
        self.draft_target = sk.engine.proposer.draft          # the loaded draft model's adapter, if any
        self.sessions: dict[Lane, Session] = {}
        self.owners: dict[tuple[Lane, int], tuple[Job, int]] = {}   # (lane, row) -> (job, choice)
        self.pending: list[Job] = []
        self.inbox: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.running_rows = 0
        self.thread = threading.Thread(target=self._run, name="spekit-worker", daemon=True)
        self.stopped = False
        metrics.gauges["spekit_running_rows"] = lambda: self.running_rows
        metrics.gauges["spekit_waiting_requests"] = lambda: self.waiting

    @property
    def waiting(self) -> int:
        """Requests not decoding yet (an approximation while the worker is inside a step)."""
        return len(self.pending) + self.inbox.qsize()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True
        self.inbox.put(("stop", None, None))
        self.thread.join(timeout=10)

    def lane(self, method: str | None, options: dict | None, cfg: SamplingConfig) -> Lane:
        """The lane of a request; an unknown method or option raises UserError (checked by building one)."""
        if method is None:
            method, base = self.default
            options = {**base, **(options or {})}
        method = resolve_method(method, self.sk.target)[0]     # a request's "auto": what it picks for this model
        get_method(method)
        opts = method_options(method, options or {})
        lane = Lane(method, tuple(sorted(vars(opts).items())), batch_key(cfg))
        return dataclasses.replace(lane, lossless=self._engine(lane).proposer.keeps_law(lane.sampling))

    def _engine(self, lane: Lane) -> Engine:
        cls = get_method(lane.method)
        if cls.needs_draft_model and self.draft_target is None:
            raise UserError(f"method '{lane.method}' needs a draft model; this server was started without --draft")
        # the target's step costs and the model's grammar compiler are shared
        return build_engine(self.sk.target, lane.method, cls.Options(**dict(lane.options)),
                            self.draft_target if cls.needs_draft_model else None,
                            stop_ids=self.sk.engine.stop_ids, grammars=self.sk.engine.grammars,
                            tokenizer=self.sk.tokenizer)

    def submit(self, job: Job) -> None:
        self.metrics.inc("spekit_requests_total", method=job.lane.method)
        self.inbox.put(("submit", job, None))

    def score(self, prompts: list[list[int]], top: int, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """The log-probabilities of the prompts' own tokens (echoed prompts), computed on the worker thread
        between steps: a list per prompt of TokenLogprob (the first token's logprob None)."""
        future = loop.create_future()
        self.inbox.put(("score", future, (prompts, top, loop)))
        return future

    def cancel(self, job: Job, choices: list[int] | None = None, reason: str = "cancelled") -> None:
        """Stop the job's choices (all by default): a disconnected client, or a text stop sequence (reason
        "stop": the label its sequence gets in the metrics)."""
        self.inbox.put(("cancel", job, (choices, reason)))

    # ---- the worker thread ----

    def _run(self) -> None:
        while not self.stopped:
            busy = any(s.busy for s in self.sessions.values())
            self._read_inbox(block=not busy)
            self._admit()
            for lane, session in list(self.sessions.items()):
                if session.busy:
                    self._step(lane, session)
            self.running_rows = sum(s.size for s in self.sessions.values())

    def _read_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, job, choices = self.inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                self.pending.append(job)
            elif kind == "cancel":
                self._cancel(job, *choices)
            elif kind == "score":
                self._score(job, *choices)

    def _score(self, future: asyncio.Future, prompts: list[list[int]], top: int, loop) -> None:
        def settle(method, value):
            if not future.done():          # the client may have gone
                method(value)
        try:
            result = [of_text(self.sk.target.score(p), p, top) for p in prompts]
        except Exception as err:  # noqa: BLE001 - the request fails, not the server
            loop.call_soon_threadsafe(settle, future.set_exception, err)
            return
        loop.call_soon_threadsafe(settle, future.set_result, result)

    def _cancel(self, job: Job, choices: list[int] | None, reason: str) -> None:
        if job in self.pending:
            self.pending.remove(job)
            return
        session = self.sessions.get(job.lane)
        for choice in sorted(job.open if choices is None else set(choices) & job.open):
            row = job.rows[choice]
            job.open.discard(choice)
            self.owners.pop((job.lane, row), None)
            state = session.rows.get(row) if session else None
            if state is not None:
                self.metrics.sequence(job.lane.method, len(state.prompt), state.stats, reason)
                session.cancel(row)

    def _admit(self) -> None:
        used = sum(s.size for s in self.sessions.values())
        while self.pending and used + self.pending[0].size <= self.max_batch_size:
            job = self.pending.pop(0)
            session = self.sessions.get(job.lane)
            try:
                if session is None:
                    self._forget_idle()
                    session = self.sessions[job.lane] = Session(self._engine(job.lane), job.lane.sampling)
                job.rows = session.add(job.prompts, job.cfg)
            except Exception as err:      # a bad prompt (UserError: 400) or a failure (500) ends this job only
                if not isinstance(err, UserError):
                    log.exception("admitting a request failed")
                job.put(Item(-1, [], error=err))
                continue
            job.open = set(range(len(job.rows)))
            for choice, row in enumerate(job.rows):
                self.owners[(job.lane, row)] = (job, choice)
            used += job.size
        self.running_rows = used

    def _forget_idle(self) -> None:
        idle = [lane for lane, s in self.sessions.items() if not s.busy]
        for lane in idle[: max(0, len(idle) - IDLE_LANES + 1)]:
            del self.sessions[lane]

    def _step(self, lane: Lane, session: Session) -> None:
        rows = session.size
        try:
            for ev in session.step():          # dispatched as they come: newcomers' first tokens go out early
                self._dispatch(lane, ev)
        except Exception as err:      # a failing batch fails its requests, not the server
            log.exception("a decoding step failed")
            del self.sessions[lane]
            for (owner_lane, row), (job, choice) in list(self.owners.items()):
                if owner_lane == lane:
                    self.owners.pop((owner_lane, row))
                    job.open.discard(choice)
                    job.put(Item(choice, [], error=err))
            return
        self.metrics.observe("spekit_step_batch_size", rows, BATCH_BUCKETS, method=lane.method)

    def _dispatch(self, lane: Lane, ev) -> None:
        owner = self.owners.get((lane, ev.row))
        if owner is None:
            return
        job, choice = owner
        if ev.result is not None:
            self.owners.pop((lane, ev.row))
            job.open.discard(choice)
            self.metrics.sequence(lane.method, len(ev.result.prompt_ids), ev.result.stats, ev.finish)
        if ev.result is not None:
            forwards = ev.result.stats.target_forwards
        else:                                          # running: the forwards so far (a stop sequence may end it here)
            state = self.sessions[lane].rows.get(ev.row) if lane in self.sessions else None
            forwards = state.stats.target_forwards if state is not None else None
        job.put(Item(choice, ev.tokens, ev.finish, logprobs=ev.logprobs, forwards=forwards))
