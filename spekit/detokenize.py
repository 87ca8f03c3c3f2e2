"""Token ids to text as they arrive: never a half multi-byte character, and text stop sequences (OpenAI `stop`)
cut the output before the stop and end the choice; text that could be the start of a stop is held back."""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0                   # characters handed out so far
        self.stopped = False

    def feed(self, tokens: list[int], final: bool) -> str:
        """New text after these tokens; sets `stopped` when a stop sequence appeared (the text ends before it)."""
        if self.stopped:
            return ""
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._emit(text, min(hits))
        safe = len(text)
        if not final:
            while safe > self.sent and text[safe - 1] == "\ufffd":     # the rest of a multi-byte character
                safe -= 1
            for stop in self.stops:                                    # a stop may be starting
                for k in range(min(len(stop) - 1, safe), 0, -1):
                    if text[:safe].endswith(stop[:k]):
                        safe -= k
                        break
        return self._emit(text, max(safe, self.sent))

    def _emit(self, text: str, end: int) -> str:
        piece = text[self.sent:end]
        self.sent = max(self.sent, end)
        return piece


def drafted_flags(accept_lengths: list[int], count: int) -> list[bool]:
    """Which of a sequence's first `count` tokens came from accepted drafts. Each target forward gained g tokens
    (SequenceStats.accept_lengths, the prefill's one first): its g - 1 accepted draft tokens, then the target's
    own (the bonus or recovered token)."""
    flags = [mark for g in accept_lengths for mark in [True] * (g - 1) + [False]]
    return flags[:count]


class MarkedStream:
    """A TextStream whose pieces say whether their tokens came from accepted drafts: feed a step's tokens with how
    many of them, from the first, were drafted. Text held back (half a character, a possible stop) goes out with
    the tokens that complete it."""

    def __init__(self, tokenizer, stops: list[str]):
        self.text = TextStream(tokenizer, stops)

    def feed(self, tokens: list[int], drafted: int, final: bool) -> list[tuple[str, bool]]:
        pieces = []
        for part, mark, last in ((tokens[:drafted], True, False), (tokens[drafted:], False, final)):
            piece = self.text.feed(part, final=last) if part or last else ""
            if piece:
                pieces.append((piece, mark))
        return pieces


def marked_text(tokenizer, token_ids: list[int], flags: list[bool], stops: list[str]) -> list[tuple[str, bool]]:
    """The text of a finished sequence as (piece, drafted) runs (see drafted_flags), cut before a stop sequence."""
    stream, pieces, start = MarkedStream(tokenizer, stops), [], 0
    while start < len(token_ids):
        end = start
        while end < len(token_ids) and flags[end] == flags[start]:
            end += 1
        run = token_ids[start:end]
        pieces += stream.feed(run, len(run) if flags[start] else 0, final=end == len(token_ids))
        start = end
    return pieces
