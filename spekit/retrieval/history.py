"""What this process's engine wrote before: the texts of its finished rows (prompt and answer), indexed by their
n-grams as they come, so that retrieval drafting (`--method rest`, and `eagle3-lookup` through it) can continue the
context's last tokens the way an earlier answer did (as SuffixDecoding, Oliaro et al. 2024, drafts from earlier
outputs). A server answering many similar requests, an agent repeating its tool calls, a batch job over one
template: the model's phrasing recurs across them far more than across the shipped datastore's generic answers.

A text runs to its row's last verified step: where a length limit or a stop token cut the answer inside a step's
accepted tokens, the rest of them (the target's own continuation) stay in it.

The index grows by one finished text at a time (every n-gram of length `ngram_min..ngram_max` that has a token
after it, keyed by the n-gram itself, with the positions after it, oldest first); past `capacity` tokens the oldest
texts leave it, their positions taken off the front of their n-grams' lists, so that adding and dropping a text cost
what its own n-grams cost (rebuilding the whole index instead cost 390 ms at 65536 tokens, at every answer once
full). A lookup returns the continuations after the latest occurrences of the longest n-gram that ends the context,
each stopping at the end of its text.

A finished text waits unindexed until the next lookup (or length) asks for the index: a batch whose drafting the
engine holds back never looks, and indexing its long prompts at each generation's start cost it about 1% of its
steps' time (profiled: 0.15 s against 7.5 s of steps for two generations of 8 rows of Spec-Bench prompts, 64 new
tokens, bfloat16). Texts that newer ones would push out past `capacity` anyway are dropped while they wait.
"""
from __future__ import annotations

from collections import deque


class History:
    def __init__(self, capacity: int, ngram_min: int = 2, ngram_max: int = 6):
        self.capacity = capacity
        self.ngrams = range(ngram_min, ngram_max + 1)
        self.clear()

    def clear(self) -> None:
        self.waiting: deque[list[int]] = deque()             # finished texts not indexed yet (see settle)
        self.waiting_size = 0
        self._texts: deque[list[int]] = deque()
        self.size = 0                                        # tokens held
        self.base = 0                                        # the position of tokens[0] (positions never reused)
        self.tokens: list[int] = []                          # the texts one after another
        self.ends: list[int] = []                            # per token: where its text ends (a position)
        self.seen: dict[tuple[int, ...], list[int]] = {}     # n-gram -> the positions right after it, oldest first

    def __len__(self) -> int:
        self.settle()
        return self.size

    @property
    def texts(self) -> deque[list[int]]:
        """The texts held, oldest first."""
        self.settle()
        return self._texts

    def settle(self) -> None:
        """Index the texts that wait."""
        while self.waiting:
            self._index(self.waiting.popleft())
        self.waiting_size = 0

    def _ngrams(self, start: int, length: int):
        """(n-gram, the position after it) for every n-gram inside the text at `start` with a token after it."""
        for end in range(start + 1, start + length):
            for n in self.ngrams:
                if end - n >= start:
                    yield tuple(self.tokens[end - n - self.base:end - self.base]), end

    def add(self, text: list[int]) -> None:
        """Hold a finished text (its last `capacity` tokens at most), indexed when the index is next asked for."""
        if self.capacity <= 0 or len(text) < 2:
            return
        text = list(text[-self.capacity:])
        self.waiting.append(text)
        self.waiting_size += len(text)
        # the oldest waiting text goes if the newer ones fill the capacity alone (indexed, it would be dropped)
        while self.waiting_size - len(self.waiting[0]) >= self.capacity:
            self.waiting_size -= len(self.waiting.popleft())

    def _index(self, text: list[int]) -> None:
        """Index a text; drop the oldest texts past capacity."""
        start = self.base + len(self.tokens)
        self._texts.append(text)
        self.size += len(text)
        self.tokens += text
        self.ends += [start + len(text)] * len(text)
        for key, pos in self._ngrams(start, len(text)):
            self.seen.setdefault(key, []).append(pos)
        while self.size > self.capacity:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        old = self._texts.popleft()
        for key, pos in self._ngrams(self.base, len(old)):
            found = self.seen[key]
            del found[0]                                     # its oldest position is this text's (lists are
                                                             # short; a deque each took 4x the memory)
            if not found:
                del self.seen[key]
        del self.tokens[:len(old)], self.ends[:len(old)]
        self.base += len(old)
        self.size -= len(old)

    def lookup(self, context: list[int], depth: int, most: int) -> tuple[int, list[list[int]]]:
        """(n, continuations): up to `most` continuations (at most `depth` tokens each, none past its text's end)
        after the latest occurrences of the longest n-gram ending `context`; (0, []) when none is held."""
        self.settle()
        for n in reversed(self.ngrams):
            starts = self.seen.get(tuple(context[-n:])) if len(context) >= n else None
            if starts:
                latest = [starts[-1 - i] - self.base for i in range(min(most, len(starts)))]
                return n, [self.tokens[s:min(s + depth, self.ends[s] - self.base)] for s in latest]
        return 0, []
