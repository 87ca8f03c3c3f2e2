"""What a request gets back: each choice's text, tokens and log-probabilities as the worker's items arrive, in
the API's response and streaming chunk shapes (tool calls included)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from ..detokenize import TextStream
from .logprobs import LogprobText
from .scheduler import Item, Job
from .schemas import ApiError, envelope, new_id, usage
from .tools import answer
from .toolstream import CallStream

if TYPE_CHECKING:
    from .app import Server


@dataclass
class Choice:
    text: TextStream
    tokens: int = 0
    finish: str | None = None
    out: str = ""
    logprobs: list = field(default_factory=list)   # TokenLogprob of each token up to a stop sequence
    offset: int = 0                                 # characters of token texts named so far (text_offset)
    echo: str = ""                                  # the prompt's text, when the request echoes it
    echo_logprobs: list = field(default_factory=list)   # its tokens' (None for the first), when asked
    forwards: int = 0                               # target forwards its tokens took (from its latest item)


class Reply:
    def __init__(self, server: Server, job: Job, req, chat: bool, choices: list[Choice], prompt_tokens: int):
        self.server, self.job, self.req, self.chat, self.choices = server, job, req, chat, choices
        self.prompt_tokens, self.first_at = prompt_tokens, None
        self.id = new_id("chatcmpl" if chat else "cmpl")
        use = req.tool_use() if chat else None
        self.tools = use if use is not None and use.active else None    # answers looked through for calls
        self.calls = [CallStream(self.tools) for _ in choices] if self.tools else []     # streamed: per choice
        self.unsent: list[list] = [[] for _ in choices]     # streamed with tools: log-probabilities held back

    @property
    def done(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    def apply(self, item: Item) -> tuple[str, str | None, list]:
        """Take one item: the choice's new text, its finish reason (None while running) and the log-probabilities
        of its tokens up to the one that completed a stop sequence (empty when not asked for)."""
        c = self.choices[item.choice]
        if c.finish is not None:
            return "", None, []             # already ended by a stop sequence
        if self.first_at is None:
            self.first_at = time.perf_counter()
            self.server.metrics.observe("spekit_time_to_first_token_seconds", self.first_at - self.job.arrived,
                                        method=self.job.lane.method)
        c.tokens += len(item.tokens)
        c.forwards = item.forwards or c.forwards
        piece, entries = self._feed(c, item)
        if c.text.stopped:
            c.finish = "stop"
            if item.finish is None:
                self.server.scheduler.cancel(self.job, [item.choice], reason="stop")
        else:
            c.finish = item.finish
        c.out += piece
        c.logprobs += entries
        if self.done:
            self.server.metrics.observe("spekit_request_duration_seconds", time.perf_counter() - self.job.arrived,
                                        method=self.job.lane.method)
        return piece, c.finish, entries

    @staticmethod
    def _feed(c: Choice, item: Item) -> tuple[str, list]:
        """The text of the item's tokens, and their log-probabilities: fed one token at a time then, so that the
        tokens after a stop sequence's last one are left out."""
        final = item.finish is not None
        if item.logprobs is None:
            return c.text.feed(item.tokens, final=final), []
        piece, entries = "", []
        for i, (token, entry) in enumerate(zip(item.tokens, item.logprobs)):
            piece += c.text.feed([token], final=final and i == len(item.tokens) - 1)
            entries.append(entry)
            if c.text.stopped:
                break
        return piece, entries

    def _logprobs(self, c: Choice, entries: list) -> dict | None:
        """A choice's `logprobs` field for these entries; None when the request did not ask for them."""
        if not self.job.cfg.wants_logprobs:
            return None
        names = LogprobText(self.server.sk.tokenizer)
        if self.chat:
            return names.chat(entries)
        out, c.offset = names.completion(entries, c.offset, top=self.job.cfg.top_logprobs > 0)
        return out

    def usage(self) -> dict:
        return usage(self.prompt_tokens, sum(c.tokens for c in self.choices))

    def figures(self) -> dict:
        """The response's `spekit` field: the method, and (once every choice has ended) the target forwards its
        answers took and τ, tokens per forward (a choice a stop sequence cut counts the forwards up to the step
        that completed the stop sequence, and its tokens up to the cut)."""
        out = {"method": self.job.lane.method, "lossless": self.job.lane.lossless}
        counted = [c for c in self.choices if c.forwards]
        if self.done and counted:
            forwards = sum(c.forwards for c in counted)
            out.update(target_forwards=forwards, tau=round(sum(c.tokens for c in counted) / forwards, 3))
        return out

    async def whole(self, item: Item, request: Request) -> dict:
        while True:
            self.apply(item)
            if self.done:
                break
            item = await self.server._next(self.job, request)
            if item is None:
                return {}
        if self.chat:
            choices = []
            for i, c in enumerate(self.choices):
                message, finish = self._message(c)
                choices.append({"index": i, "message": message, "logprobs": self._logprobs(c, c.logprobs),
                                "finish_reason": finish})
        else:
            choices = [{"index": i, "text": c.echo + c.out, "finish_reason": c.finish,
                        "logprobs": self._logprobs(c, c.echo_logprobs + c.logprobs)}
                       for i, c in enumerate(self.choices)]
        kind = "chat.completion" if self.chat else "text_completion"
        return envelope(kind, self.id, self.server.settings.model_id, choices, usage=self.usage(),
                        spekit=self.figures())

    def _message(self, c: Choice) -> tuple[dict, str | None]:
        """A chat choice's message and finish reason (with tools: its calls as tool_calls)."""
        if self.tools is None:
            return {"role": "assistant", "content": c.out}, c.finish
        return answer(c.out, c.finish, self.tools)

    def _chunk(self, index: int, piece: str | None, finish: str | None, role: bool = False,
               entries: list | None = None, delta: dict | None = None) -> str:
        logprobs = self._logprobs(self.choices[index], entries) if entries else None
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({"content": piece} if piece else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": piece or "", "logprobs": logprobs, "finish_reason": finish}
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(envelope(kind, self.id, self.server.settings.model_id, [choice]))

    def _tool_chunks(self, index: int, piece: str, finish: str | None, entries: list):
        """A request with tools, streamed (spekit.server.toolstream): content while no call may have begun, each
        call's name as soon as it is written, then its arguments as they come. Log-probabilities go with the
        first delta sent after their tokens, held back with the text they belong to."""
        calls = self.calls[index]
        self.unsent[index] += entries
        for delta in calls.feed(piece):
            yield self._chunk(index, None, None, entries=self.unsent[index], delta=delta)
            self.unsent[index] = []
        if finish:
            deltas, finish = calls.end(finish)
            for delta in deltas:
                yield self._chunk(index, None, None, entries=self.unsent[index], delta=delta)
                self.unsent[index] = []
            yield self._chunk(index, None, finish, entries=self.unsent[index], delta={})

    async def events(self, item: Item):
        try:
            if self.chat:
                for i in range(len(self.choices)):
                    yield self._chunk(i, None, None, role=True)
            for i, c in enumerate(self.choices):
                if c.echo:                        # the echoed prompt first
                    yield self._chunk(i, c.echo, None, entries=c.echo_logprobs)
            while True:
                if item.error is not None:
                    yield sse(ApiError(500, f"generation failed: {item.error}", kind="server_error").body())
                    break
                piece, finish, entries = self.apply(item)
                if self.tools is not None:
                    for chunk in self._tool_chunks(item.choice, piece, finish, entries):
                        yield chunk
                elif piece or finish or entries:
                    yield self._chunk(item.choice, piece, finish, entries=entries)
                if self.done:
                    break
                item = await self.job.queue.get()
            if self.req.stream_options and self.req.stream_options.include_usage:
                kind = "chat.completion.chunk" if self.chat else "text_completion"
                yield sse(envelope(kind, self.id, self.server.settings.model_id, [], usage=self.usage(),
                                    spekit=self.figures()))
            yield "data: [DONE]\n\n"
        finally:
            if not self.done:                    # the client went away: stop its rows, free their slots
                self.server.scheduler.cancel(self.job)


class Echo:
    """The answer to echo with max_tokens 0: each prompt's text and its tokens' log-probabilities, nothing
    generated."""

    def __init__(self, server: Server, req, cfg, prompts: list[list[int]], echoes: list[tuple[str, list]]):
        self.server, self.req, self.cfg, self.prompts, self.echoes = server, req, cfg, prompts, echoes

    def response(self) -> dict:
        names = LogprobText(self.server.sk.tokenizer)
        choices = []
        for k in range(len(self.prompts) * self.cfg.n):
            text, entries = self.echoes[k // self.cfg.n]
            logprobs = names.completion(entries, 0, top=self.cfg.top_logprobs > 0)[0] if self.cfg.wants_logprobs \
                else None
            choices.append({"index": k, "text": text, "logprobs": logprobs, "finish_reason": "length"})
        prompt_tokens = sum(len(p) for p in self.prompts) * self.cfg.n
        return envelope("text_completion", new_id("cmpl"), self.server.settings.model_id, choices,
                        usage=usage(prompt_tokens, 0), spekit={"method": "score"})


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
