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
