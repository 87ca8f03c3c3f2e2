"""OpenAI's two shapes of log-probabilities, from the engine's TokenLogprob entries (spekit.logprobs: the target's
raw log-probabilities, the ones plain decoding gives). A token's text is its own decoding; where one token holds
part of a multi-byte character that text is U+FFFD, and `bytes` gives its UTF-8 bytes as OpenAI does."""
from __future__ import annotations

from ..logprobs import TokenLogprob


class LogprobText:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def name(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def chat(self, entries: list[TokenLogprob]) -> dict:
        """The chat API's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
        def one(token: int, logprob: float) -> dict:
            text = self.name(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        content = [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
        return {"content": content, "refusal": None}

    def completion(self, entries: list[TokenLogprob], offset: int, top: bool) -> tuple[dict, int]:
        """The legacy completions API's `logprobs` (tokens, token_logprobs, top_logprobs, text_offset) for these
        entries, the first at character `offset` of the choice's text; returns it and the offset after them."""
        tokens = [self.name(e.token) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        tops = [None if e.logprob is None else self._top(e) for e in entries] if top else None
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": offsets}, offset

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        """{text: logprob} of the top tokens; two tokens with one text (parts of multi-byte characters both read
        U+FFFD) keep the likelier's."""
        out: dict[str, float] = {}
        for token, logprob in entry.top:
            out.setdefault(self.name(token), logprob)
        return out
