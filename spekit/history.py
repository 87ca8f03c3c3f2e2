"""What this process's engine wrote before: the texts of its finished rows (prompt and answer), indexed by their
n-grams as they come, so that retrieval drafting (`--method rest`, and `eagle3-lookup` through it) can continue the
context's last tokens the way an earlier answer did (as SuffixDecoding, Oliaro et al. 2024, drafts from earlier
outputs). A server answering many similar requests, an agent repeating its tool calls, a batch job over one
template: the model's phrasing recurs across them far more than across the shipped datastore's generic answers.

A text runs to its row's last verified step: where a length limit or a stop token cut the answer inside a step's
accepted tokens, the rest of them (the target's own continuation) stay in it.

The index grows by one finished text at a time (every n-gram of length `ngram_min..ngram_max` that has a token
after it, keyed by the n-gram itself); past `capacity` tokens the oldest texts are dropped and the index is
rebuilt from the rest. A lookup returns the continuations after the latest occurrences of the longest n-gram that
ends the context, each stopping at the end of its text.
"""
from __future__ import annotations

from collections import deque


class History:
    def __init__(self, capacity: int, ngram_min: int = 2, ngram_max: int = 6):
        self.capacity = capacity
        self.ngrams = range(ngram_min, ngram_max + 1)
        self.texts: deque[list[int]] = deque()
        self.size = 0                                        # tokens held
        self._index()

    def _index(self) -> None:
        self.tokens: list[int] = []                          # the texts one after another
        self.ends: list[int] = []                            # per position: where its text ends (exclusive)
        self.seen: dict[tuple[int, ...], list[int]] = {}     # n-gram -> the positions right after it
        for text in self.texts:
            self._append(text)

    def _append(self, text: list[int]) -> None:
        start = len(self.tokens)
        self.tokens += text
        self.ends += [start + len(text)] * len(text)
        for end in range(start + 1, start + len(text)):      # the n-grams with a token after them
            for n in self.ngrams:
                if end - n >= start:
                    self.seen.setdefault(tuple(self.tokens[end - n:end]), []).append(end)

    def __len__(self) -> int:
        return self.size

    def add(self, text: list[int]) -> None:
        """Index a finished text (its last `capacity` tokens at most); drop the oldest texts past capacity."""
        if self.capacity <= 0 or len(text) < 2:
            return
        text = list(text[-self.capacity:])
        self.texts.append(text)
        self.size += len(text)
        if self.size <= self.capacity:
            self._append(text)
            return
        while self.size > self.capacity:
            self.size -= len(self.texts.popleft())
        self._index()

    def clear(self) -> None:
        self.texts.clear()
        self.size = 0
        self._index()

    def lookup(self, context: list[int], depth: int, most: int) -> tuple[int, list[list[int]]]:
        """(n, continuations): up to `most` continuations (at most `depth` tokens each, none past its text's end)
        after the latest occurrences of the longest n-gram ending `context`; (0, []) when none is held."""
        for n in reversed(self.ngrams):
            starts = self.seen.get(tuple(context[-n:])) if len(context) >= n else None
            if starts:
                return n, [self.tokens[s:min(s + depth, self.ends[s])] for s in reversed(starts[-most:])]
        return 0, []
