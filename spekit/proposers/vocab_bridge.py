"""Text between two vocabularies: what a draft model of another tokenizer needs to follow the target's tokens and
to hand its own drafts over as target tokens (spekit.proposers.cross_draft).

Every token is read as the bytes it adds to the text (`piece_bytes`: byte-level BPE pieces through the byte alphabet
of GPT-2's tokenizer, SentencePiece pieces with their space marker and byte-fallback pieces as bytes; special tokens
add nothing). Then
- `Rows` keeps, per row, the target's text as bytes and the draft's tokens for it, growing incrementally: the
  target's new tokens add their bytes; the draft's last few tokens (which a merge with the new text might change)
  and whatever follows are encoded again, only that tail, never the whole text. A text ending inside a character
  (byte-fallback tokens of one character split over steps) waits for the rest.
- `Shared` pairs the tokens whose bytes are equal in both vocabularies (the token-level intersection of Timor et al.,
  ICML 2025): under sampling the draft draws only among them, so each drawn token is one target token.
Nothing here decides anything: the target verifies every draft with the exact rule, so a draft that the target
would have tokenized otherwise costs acceptance, never exactness."""
from __future__ import annotations

from functools import lru_cache

import torch

from ..config import UserError

LOOKBACK = 2        # the draft's last tokens encoded again when text follows them (a merge may change them)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable bytes stand for themselves, the rest for chr(256 + n) in order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {chr(b): b for b in kept}, 0
    for b in range(256):
        if b not in kept:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def _byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in str(backend.decoder)


def piece_bytes(tokenizer) -> list[bytes | None]:
    """Per token id, the bytes it adds to the text; None for special tokens (they add none, and are never drafted
    across vocabularies)."""
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    special = set(tokenizer.all_special_ids)
    for tid, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            special.add(int(tid))
    alphabet = _byte_alphabet() if _byte_level(tokenizer) else None
    out: list[bytes | None] = []
    for tid, piece in enumerate(pieces):
        if piece is None or tid in special:
            out.append(None)
        elif alphabet is not None and all(c in alphabet for c in piece):
            out.append(bytes(alphabet[c] for c in piece))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return out


def complete(text: bytes) -> int:
    """How many bytes of `text` end on a character boundary (a trailing incomplete UTF-8 sequence left out)."""
    n = len(text)
    for back in range(1, min(4, n) + 1):
        byte = text[n - back]
        if byte < 0x80:
            return n
        if byte >= 0xC0:                               # a lead byte: is its sequence whole?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return n if back >= need else n - back
    return n


def check_writable(target_bytes: list[bytes | None], draft_tok, draft_bytes: list[bytes | None]) -> None:
    """UserError when the draft's tokenizer cannot write the target's text: more than 1% of the target's tokens
    come back from it as other bytes (its unknown token, or characters it drops). Byte-level tokenizers and those
    with byte fallback write any text; a few tokens it writes otherwise (a normalizer's doing) only draft worse."""
    texts = [(b, b.decode("utf-8")) for b in target_bytes if b and _utf8(b)]
    if not texts:
        return
    encoded = draft_tok([t for _, t in texts], add_special_tokens=False).input_ids
    bad = [t for (b, t), ids in zip(texts, encoded)
           if b"".join(draft_bytes[i] or b"?" if 0 <= i < len(draft_bytes) else b"?" for i in ids).strip() != b.strip()]
    if len(bad) > 0.01 * len(texts):
        raise UserError(f"the draft's tokenizer cannot write the target's text: {len(bad)} of the target's "
                        f"{len(texts)} token texts come back otherwise (such as {bad[:3]!r}); a draft across "
                        "vocabularies needs a tokenizer that writes any text (byte-level, or with byte fallback)")


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


class Shared:
    """The tokens both vocabularies hold with the same bytes: draft ids [S] and their target ids [S]."""

    def __init__(self, target_bytes: list[bytes | None], draft_bytes: list[bytes | None]):
        where = {b: i for i, b in enumerate(target_bytes) if b}
        pairs = [(d, where[b]) for d, b in enumerate(draft_bytes) if b and b in where]
        if not pairs:
            raise UserError("the draft's vocabulary shares no token with the target's")
        self.draft_ids = torch.tensor([d for d, _ in pairs])
        self.target_ids = torch.tensor([t for _, t in pairs])
        self.to_target = torch.full((len(draft_bytes),), -1, dtype=torch.long)
        self.to_target[self.draft_ids] = self.target_ids
        self.blocked = torch.ones(len(draft_bytes), dtype=torch.bool)
        self.blocked[self.draft_ids] = False


class Rows:
    """Per row: the target's text (bytes) and the draft's tokens for it, with the byte offset where each ends."""

    def __init__(self, target_tok, draft_tok, target_bytes: list[bytes | None], draft_bytes: list[bytes | None]):
        self.target_tok, self.draft_tok = target_tok, draft_tok
        self.target_bytes, self.draft_bytes = target_bytes, draft_bytes
        self.text: list[bytearray] = []            # the target's text
        self.seen: list[int] = []                  # target tokens read into it
        self.ids: list[list[int]] = []             # the draft's tokens for text[:ends[-1]]
        self.ends: list[list[int]] = []
        self.floor: list[int] = []                 # the draft's own leading special tokens (never encoded again)

    def add(self, count: int) -> None:
        for _ in range(count):
            self.text.append(bytearray())
            self.seen.append(0)
            self.ids.append([])
            self.ends.append([])
            self.floor.append(0)

    def select(self, rows: list[int]) -> None:
        for name in ("text", "seen", "ids", "ends", "floor"):
            setattr(self, name, [getattr(self, name)[r] for r in rows])

    def sync(self, b: int, tokens: list[int]) -> list[int]:
        """Row b's draft tokens for the text of the target's `tokens` (its whole context so far)."""
        new = tokens[self.seen[b]:]
        if self.seen[b] == 0:
            self._start(b, tokens)
        elif new:
            for t in new:
                self.text[b] += (self.target_bytes[t] if 0 <= t < len(self.target_bytes) else None) or b""
            self.seen[b] = len(tokens)
            self._encode_tail(b)
        return self.ids[b]

    def _start(self, b: int, tokens: list[int]) -> None:
        """A new row: its prompt's text, encoded whole once (with the draft's own leading special tokens)."""
        self.text[b] = bytearray(b"".join(self.target_bytes[t] or b"" for t in tokens
                                          if 0 <= t < len(self.target_bytes)))
        self.seen[b] = len(tokens)
        end = complete(bytes(self.text[b]))
        ids = self.draft_tok(bytes(self.text[b][:end]).decode("utf-8", "replace")).input_ids
        lead = 0
        while lead < len(ids) and self.draft_bytes[ids[lead]] is None:
            lead += 1
        self.ids[b], self.ends[b], self.floor[b] = [], [], lead
        self._append(b, ids, 0)

    def _encode_tail(self, b: int) -> None:
        ids, ends = self.ids[b], self.ends[b]
        keep = max(self.floor[b], len(ids) - LOOKBACK)
        text = self.text[b]
        while keep > self.floor[b] and ends[keep - 1] < len(text) and (text[ends[keep - 1]] & 0xC0) == 0x80:
            keep -= 1                                     # restart on a character's first byte
        start = ends[keep - 1] if keep else 0
        del ids[keep:], ends[keep:]
        end = complete(bytes(self.text[b]))
        if end > start:
            piece = bytes(self.text[b][start:end]).decode("utf-8", "replace")
            self._append(b, self.draft_tok(piece, add_special_tokens=False).input_ids, start)

    def _append(self, b: int, ids: list[int], start: int) -> None:
        at = start
        for t in ids:
            at += len(self.draft_bytes[t] or b"") if 0 <= t < len(self.draft_bytes) else 0
            self.ids[b].append(t)
            self.ends[b].append(at)

    def to_target(self, drafted: list[int]) -> list[int]:
        """Target tokens for the text of the draft's tokens `drafted` (greedy drafts), encoded by the target's
        tokenizer. The last one goes unless it is the draft's last token too (the same bytes: both vocabularies
        end a token there) or the draft stopped after it: text after it might merge it into another token."""
        text = b"".join(self.draft_bytes[t] or b"" for t in drafted if 0 <= t < len(self.draft_bytes))
        text = text[:complete(text)]
        if not text or (text[0] & 0xC0) == 0x80:    # nothing, or the rest of a character the text left open
            return []
        ids = self.target_tok(text.decode("utf-8", "replace"), add_special_tokens=False).input_ids
        last = self.draft_bytes[drafted[-1]]
        if ids and last is not None and self.target_bytes[ids[-1]] != last:
            ids = ids[:-1]
        return ids
