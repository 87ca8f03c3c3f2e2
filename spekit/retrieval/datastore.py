"""A datastore for retrieval drafting (`--method rest`, after REST, He et al. 2024): token sequences the target
wrote before (its answers to training prompts, never the evaluation questions), indexed by their n-grams, so that
the continuations of the context's last n tokens are found by binary search.

On disk a datastore is a drafter folder like a head's (`heads.base.write_dir`): `model.safetensors` holds
`tokens` [T] int32 (the sequences joined, SEP between them) and `config.json` is
    {"kind": "datastore", "target": {...heads.base.target_info...}, "meta": {"sequences": ..., "command": ...}}.

The index: for every n in [ngram_min, ngram_max] a polynomial hash (int64, wrapping) of each n-gram that has a
token after it, sorted. A lookup hashes the context's last n tokens the same way, finds the equal hashes with
`searchsorted`, and keeps only the positions whose n tokens really match (a hash collision drafts nothing wrong).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..config import UserError, read_json_object

SEP = -1
KIND = "datastore"
_MULT = np.int64(1_000_003)


def _hashes(tokens: np.ndarray, most: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per n in 1..most: hash and validity of the n-gram ending before each position e of tokens [T] (int64),
    ([T+1], [T+1] bool), valid where e >= n and the n-gram holds no SEP. One pass per n from the one before:
    hash(t[e-n:e]) = hash(t[e-n:e-1]) * M + t[e-1]."""
    t = len(tokens)
    h, ok = np.zeros(t + 1, dtype=np.int64), np.ones(t + 1, dtype=bool)
    out = [(h, ok)]                                   # n = 0: the empty n-gram
    for n in range(1, most + 1):
        prev_h, prev_ok = out[-1]
        h, ok = np.zeros(t + 1, dtype=np.int64), np.zeros(t + 1, dtype=bool)
        with np.errstate(over="ignore"):
            h[n:] = prev_h[n - 1:t] * _MULT + tokens[n - 1:]
        ok[n:] = prev_ok[n - 1:t] & (tokens[n - 1:] != SEP)
        out.append((h, ok))
    return out


def _key(ngram: list[int]) -> np.int64:
    """The hash `_hashes` gives this n-gram, in Python ints (a lookup hashes a few tokens, where numpy's calls cost
    more than the arithmetic): the int64 polynomial, wrapping as numpy's does."""
    h = 0
    for t in ngram:
        h = (h * int(_MULT) + t) & 0xFFFF_FFFF_FFFF_FFFF
    return np.int64(h - (1 << 64) if h >= 1 << 63 else h)


def _join(sequences: list[list[int]]) -> list[int]:
    """The sequences one after another, SEP after each."""
    return [t for seq in sequences for t in (*seq, SEP)]


class Datastore:
    """Token sequences and their n-gram index. tokens: [T] int64 with SEP between sequences."""

    def __init__(self, tokens: np.ndarray, ngram_min: int = 2, ngram_max: int = 6, meta: dict | None = None):
        if not 1 <= ngram_min <= ngram_max:
            raise UserError(f"need 1 <= retrieve_min <= retrieve_max, got {ngram_min} and {ngram_max}")
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.meta = dict(meta or {})
        self.ngrams = range(ngram_min, ngram_max + 1)
        self.index: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        end = len(self.tokens)
        hashes = _hashes(self.tokens, ngram_max)
        for n in self.ngrams:
            h, ok = hashes[n][0], hashes[n][1].copy()
            ok[end] = False                               # nothing follows the last token
            ok[:end] &= self.tokens != SEP                # a continuation must start with a token
            pos = np.nonzero(ok)[0]
            order = np.argsort(h[pos], kind="stable")
            self.index[n] = (h[pos][order], pos[order])

    @classmethod
    def from_sequences(cls, sequences: list[list[int]], **kwargs) -> "Datastore":
        return cls(np.array(_join(sequences), dtype=np.int64), **kwargs)

    def __len__(self) -> int:
        return int((self.tokens != SEP).sum())

    def lookup(self, context: list[int], depth: int, most: int) -> tuple[int, list[list[int]]]:
        """(n, continuations): up to `most` continuations (each at most `depth` tokens, ending at a sequence's end)
        of the longest n-gram ending `context` that the datastore holds, spread evenly over its occurrences; (0, [])
        when none matches."""
        tail = context[-self.ngrams[-1]:]
        for n in reversed(self.ngrams):
            if len(context) < n:
                continue
            suffix = np.array(tail[len(tail) - n:], dtype=np.int64)
            key = _key(tail[len(tail) - n:])
            keys, pos = self.index[n]
            lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
            if hi == lo:
                continue
            picks = pos[lo + (np.arange(min(most, hi - lo)) * (hi - lo)) // min(most, hi - lo)]
            real = (self.tokens[picks[:, None] - n + np.arange(n)] == suffix).all(1)
            picks = picks[real]
            if len(picks) == 0:
                continue
            idx = picks[:, None] + np.arange(depth)
            inside = idx < len(self.tokens)
            vals = np.where(inside, self.tokens[np.minimum(idx, len(self.tokens) - 1)], SEP)
            keep = np.cumprod(vals != SEP, axis=1).astype(bool)
            return n, [row[k].tolist() for row, k in zip(vals, keep)]
        return 0, []


def write_datastore(directory: str | Path, sequences: list[list[int]], target_info: dict, meta: dict) -> Path:
    """Save sequences as a datastore folder (atomically, see heads.base.write_dir)."""
    from ..heads.base import write_dir
    joined = _join(sequences)
    tokens = torch.tensor(joined, dtype=torch.int32)
    meta = {"sequences": len(sequences), "tokens": len(joined) - len(sequences), **meta}
    return write_dir(directory, {"tokens": tokens}, {"kind": KIND, "target": target_info, "meta": meta})


def read_info(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise UserError(f"{directory} is not a spekit datastore folder (no config.json); build one with "
                        f"`spekit train rest`")
    from ..heads.base import check_fields
    info = read_json_object(path, "datastore config",
                            "a spekit datastore's config (a JSON object with kind and target)")
    if info.get("kind") != KIND:
        raise UserError(f"{directory} holds a {info.get('kind')!r} drafter, not a datastore")
    check_fields(path, info)
    return info


def load_datastore(directory: str | Path, vocab_size: int, ngram_min: int = 2, ngram_max: int = 6) -> Datastore:
    """Load a datastore for a model with this vocabulary, checking that its tokens fit it."""
    info = read_info(directory)
    made_for = info["target"]["vocab_size"]
    if made_for != vocab_size:
        raise UserError(f"{directory} was built for another model (vocab_size {made_for}, this model has "
                        f"{vocab_size}); build one for it with `spekit train rest`")
    weights = Path(directory) / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"{weights} is missing")
    try:
        tokens = load_file(str(weights))["tokens"]
    except (SafetensorError, OSError, ValueError, KeyError) as err:
        raise UserError(f"{directory}/model.safetensors cannot be read as a datastore ({err!r}); the file is "
                        f"corrupt or truncated") from None
    tokens = tokens.to(torch.int64).numpy()
    if tokens.ndim != 1 or (tokens < SEP).any() or (tokens >= vocab_size).any():
        raise UserError(f"{directory}/model.safetensors holds token ids outside this model's vocabulary")
    return Datastore(tokens, ngram_min, ngram_max, info.get("meta"))
