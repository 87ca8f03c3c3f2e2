"""A batch's place in llama.cpp's cache: one sequence (and, with the exact kernels, one cache stream) per row, behind
the cache interface the engine uses (`length`, `keep` of the accepted path, row selection and merging)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .llama_cpp import LlamaTarget


@dataclass
class Row:
    """One row of a cache: its llama sequence, the tokens that sequence holds by position, and every slot the
    engine has appended (as KVState's slot axis: (token, position or -1, sequence ids))."""
    seq: int
    tokens: list[int]
    slots: list[tuple[int, int, tuple[int, ...]]]


HOLE = (0, -1, ())


class LlamaKV:
    """The engine's view of some rows of the llama context (the KVState interface the engine and the draft
    proposer use: length, next_positions, keep, compact, select_rows, merge, copied, release, reserve)."""

    def __init__(self, target: "LlamaTarget", rows: list[Row]):
        self.target, self.rows = target, rows

    @property
    def length(self) -> int:
        return len(self.rows[0].slots) if self.rows else 0

    @property
    def capacity(self) -> int:
        return self.target.settings.ctx_size

    def next_positions(self) -> torch.Tensor:
        return torch.tensor([len(r.tokens) for r in self.rows], dtype=torch.long)

    def reserve(self, slots: int) -> None:
        """Nothing to allocate: a row's stream holds `capacity` cells, and the target's max_positions (the same
        number) keeps prompts, answers and drafts inside it."""

    def keep(self, start: int, keep_idx: torch.Tensor, counts: torch.Tensor, in_place: bool | None = None) -> None:
        """Of the slots from `start` on, keep those at keep_idx [B, M] (the first counts[b] of row b; the path from
        the step's root, in order) and drop the rest: the row's sequence then holds its committed tokens and them."""
        idx, counts = keep_idx.tolist(), counts.tolist()
        for b, row in enumerate(self.rows):
            new = row.slots[start:]
            kept = [new[i] for i in idx[b][: counts[b]]]
            self.target._commit(row, new, kept)
            row.slots = row.slots[:start] + kept + [HOLE] * (len(idx[b]) - counts[b])

    def crop(self, lengths: list[int]) -> None:
        """Row b keeps the tokens at positions below lengths[b] (KVState.crop)."""
        for row, length in zip(self.rows, lengths):
            if length < len(row.tokens):
                self.target.L.llama_memory_seq_rm(self.target.mem, row.seq, length, -1)
                del row.tokens[length:]
                row.slots = [s if s[1] < length else HOLE for s in row.slots]

    def compact(self, slack: int = 64) -> bool:
        """Drop holes from the slot axis once they are many (llama.cpp's cells do not move: only the bookkeeping)."""
        real = [[s for s in r.slots if s[1] >= 0] for r in self.rows]
        longest = max((len(x) for x in real), default=0)
        if self.length - longest <= max(slack, self.length // 4):
            return False
        for r, x in zip(self.rows, real):
            r.slots = [HOLE] * (longest - len(x)) + x
        return True

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = [int(i) for i in rows.tolist()] if isinstance(rows, torch.Tensor) else list(rows)
        for i, row in enumerate(self.rows):
            if i not in keep:
                self.target._retire(row)
        self.rows = [self.rows[i] for i in keep]

    def merge(self, other: "LlamaKV") -> None:
        """Append other's rows (same llama context): requests joining a running batch."""
        assert other.target is self.target, "rows of another llama context"
        length = max(self.length, other.length)
        for row in self.rows + other.rows:
            row.slots = [HOLE] * (length - len(row.slots)) + row.slots
        self.rows = self.rows + other.rows
        other.rows = []

    def copied(self) -> "LlamaKV":
        return LlamaKV(self.target, [self.target._copy(row) for row in self.rows])

    def release(self) -> None:
        for row in self.rows:
            self.target._retire(row)
        self.rows = []
