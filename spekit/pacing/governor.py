"""The governor: holds speculation back while it is slower than plain steps, measured end to end (greedy only)."""
from __future__ import annotations

from .priors import bucket, context_bucket


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
    several plain steps (a GPU whose host launches each of a drafter's many small kernels), eight steps before a
    verdict lose more than the whole answer's drafts could win. The proposers' own pacing decides what to draft; this
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
