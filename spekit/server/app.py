"""The HTTP routes. Text lives here: prompts are encoded, tokens decoded, stop sequences applied; the worker
(`scheduler.py`) sees token ids only."""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..api import Spekit
from ..config import UserError
from .guard import Guard
from .logprobs import LogprobText
from .metrics import Metrics
from .scheduler import Item, Job, Scheduler
from .schemas import ApiError, ChatRequest, CompletionRequest, envelope, new_id, parse, usage
from .tools import ToolUse, answer, chat_messages, reads_tools
from .toolstream import CallStream
from ..detokenize import TextStream


@dataclass(frozen=True)
class Settings:
    model_id: str
    max_prompt_tokens: int
    max_new_tokens: int = 512
    max_batch_size: int = 16
    max_body_bytes: int = 1 << 20
    api_key: str | None = None
    method: str = "plain"
    options: tuple = ()          # (name, value) pairs of the default method's options


@dataclass
class _Choice:
    text: TextStream
    tokens: int = 0
    finish: str | None = None
    out: str = ""
    logprobs: list = field(default_factory=list)   # TokenLogprob of each token up to a stop sequence
    offset: int = 0                                 # characters of token texts named so far (text_offset)
    echo: str = ""                                  # the prompt's text, when the request echoes it
    echo_logprobs: list = field(default_factory=list)   # its tokens' (None for the first), when asked
    forwards: int = 0                               # target forwards its tokens took (from its latest item)


def create_app(sk: Spekit, settings: Settings) -> FastAPI:
    metrics = Metrics()
    scheduler = Scheduler(sk, settings.method, dict(settings.options), settings.max_batch_size, metrics)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="spekit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes, metrics=metrics)
    _errors(app)
    serve = _Server(sk, settings, scheduler, metrics)

    @app.get("/health")
    async def health():
        return {"status": "ok", "running_rows": scheduler.running_rows, "waiting": scheduler.waiting}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_id, "object": "model", "created": 0,
                                             "owned_by": "spekit"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await _read_json(request, settings.max_body_bytes))
        if req.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        return await serve(request, req, serve.encode_completion(req.prompt), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse(ChatRequest, await _read_json(request, settings.max_body_bytes))
        return await serve(request, req, [serve.encode_chat(req.messages, req.tool_use())], chat=True)

    return app


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(UserError)
    async def user_error(request, err: UserError):
        return JSONResponse(ApiError(400, str(err)).body(), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err):
        return JSONResponse(ApiError(400, str(err)).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(err.status_code, str(err.detail), kind=kind).body(), status_code=err.status_code)


async def _read_json(request: Request, limit: int):
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):             # RecursionError: nested deeper than the parser goes
        raise ApiError(400, "the request body is not valid JSON") from None
    problem = _body_problem(data)
    if problem is not None:
        raise ApiError(400, *problem)
    return data


MAX_BODY_DEPTH = 128   # no request of the API nests deeper than a handful of levels (a JSON schema, tool arguments)


def _body_problem(data) -> tuple[str, str | None] | None:
    """(message, param) of what no handler can take in a parsed body, or None: nesting deeper than MAX_BODY_DEPTH
    (the parser's own limit moves with sys.getrecursionlimit(), which torch.compile raises), or a string that is not
    valid Unicode at its place (e.g. messages.0.content; "" for the body's own keys): JSON's escapes allow a lone
    surrogate, which no tokenizer or grammar can encode. One loop, not recursion: the body may be nested deeply."""
    stack = [("", data, 0)]
    while stack:
        place, value, level = stack.pop()
        if level > MAX_BODY_DEPTH:
            return f"the request body is not valid JSON here: nested deeper than {MAX_BODY_DEPTH} levels", None
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return (f"{place or 'the body'} holds invalid Unicode (a lone surrogate escape such as \\ud800)",
                        place or None)
        elif isinstance(value, dict):
            stack += [(f"{place}.{k}" if place else str(k), v, level + 1) for k, v in value.items()]
            stack += [(place, k, level + 1) for k in value]                 # keys are strings too
        elif isinstance(value, list):
            stack += [(f"{place}.{i}" if place else str(i), v, level + 1) for i, v in enumerate(value)]
    return None


class _Server:
    """One request from its prompts to its response (JSON or server-sent events)."""

    def __init__(self, sk: Spekit, settings: Settings, scheduler: Scheduler, metrics: Metrics):
        self.sk, self.settings, self.scheduler, self.metrics = sk, settings, scheduler, metrics

    def encode_completion(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, "prompt is empty", "prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if any(isinstance(p, str) and not p.strip() for p in prompt):
            raise ApiError(400, "a prompt is empty", "prompt")
        return [list(p) if isinstance(p, list) else self.sk.encode(p, chat=False) for p in prompt]

    def encode_chat(self, messages, use: ToolUse | None = None) -> list[int]:
        """The messages through the chat template, with the request's tools (spekit.server.tools)."""
        if not self.sk.has_chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        turns, tools = chat_messages([m.turn() for m in messages], use, reads_tools(self.sk.tokenizer.chat_template))
        try:
            return self.sk.encode_chat(turns, tools)
        except Exception as err:       # a template that raises on these messages (its own checks, jinja errors)
            raise ApiError(400, f"the model's chat template cannot render these messages: {err}", "messages") \
                from None

    def _check(self, req, prompts: list[list[int]]) -> None:
        s, target = self.settings, self.sk.target
        if req.model is not None and req.model != s.model_id:
            raise ApiError(404, f"the model '{req.model}' does not exist; this server has '{s.model_id}'", "model",
                           code="model_not_found")
        req.unsupported()
        for tok, _ in req.bias_pairs():
            if tok >= target.vocab_size:
                raise ApiError(400, f"logit_bias names token {tok}; the vocabulary has {target.vocab_size} tokens",
                               "logit_bias")
        for p in prompts:
            if not p:
                raise ApiError(400, "a prompt is empty", "prompt")
            if len(p) > s.max_prompt_tokens:
                raise ApiError(400, f"the prompt has {len(p)} tokens; this server takes at most "
                                    f"{s.max_prompt_tokens}", "prompt", code="context_length_exceeded")
            if any(not 0 <= t < target.vocab_size for t in p):
                raise ApiError(400, f"token ids must be in [0, {target.vocab_size})", "prompt")
        if len(prompts) * req.n > s.max_batch_size:
            raise ApiError(400, f"{len(prompts)} prompt(s) x n={req.n} is more than this server's batch of "
                                f"{s.max_batch_size}", "n")

    def _check_context(self, req, prompts: list[list[int]]) -> None:
        """A prompt plus the max_tokens the request gave over the model's context: refused, as OpenAI and vLLM do,
        not answered cut short (without max_tokens an answer runs to the context's end, finish "length")."""
        asked, context = getattr(req, "max_completion_tokens", None) or req.max_tokens, self.sk.target.max_positions
        for p in prompts if asked else []:
            if len(p) + asked > context:
                raise ApiError(400, f"this model's context is {context} tokens, and the request asks for "
                                    f"{len(p) + asked} ({len(p)} in the prompt, {asked} to write); lower max_tokens "
                                    f"or shorten the prompt", "max_tokens", code="context_length_exceeded")

    async def __call__(self, request: Request, req, prompts: list[list[int]], chat: bool):
        self._check(req, prompts)
        score_only = not chat and req.score_only
        if score_only and req.stream:
            raise ApiError(400, "max_tokens 0 (scoring the echoed prompt) does not stream", "stream")
        cfg = req.sampling(self.settings.max_new_tokens if chat else 16, self.settings.max_new_tokens)
        self._check_context(req, prompts)
        echoes = await self._echoes(req, prompts, cfg) if not chat and req.echo else None
        if score_only:
            return JSONResponse(_Echo(self, req, cfg, prompts, echoes).response())
        extra = req.spekit
        try:
            lane = self.scheduler.lane(extra.method if extra else None, extra.options if extra else None, cfg)
        except UserError as err:
            raise ApiError(400, str(err), "spekit") from None
        if cfg.constrained:          # a grammar that does not compile is the request's error, found before queueing
            try:
                self.sk.engine.grammars.constraint(cfg)
            except UserError as err:
                fmt = "tools" if getattr(req, "tools", None) and not req.response_format else "response_format"
                raise ApiError(400, str(err), fmt if cfg.json_schema else "spekit") from None
        job = Job(lane, prompts, cfg, asyncio.get_running_loop(), asyncio.Queue())
        choices = [_Choice(TextStream(self.sk.tokenizer, req.stop or [])) for _ in range(job.size)]
        for k, c in enumerate(choices if echoes else []):
            c.echo, c.echo_logprobs = echoes[k // cfg.n]
        reply = _Reply(self, job, req, chat, choices, sum(len(p) for p in prompts))
        self.scheduler.submit(job)
        try:
            first = await self._next(job, request)
            if first is None:
                return JSONResponse({}, status_code=499)     # the client has gone
            if req.stream:
                return StreamingResponse(reply.events(first), media_type="text/event-stream")
            return JSONResponse(await reply.whole(first, request))
        except BaseException:
            self.scheduler.cancel(job)
            raise

    async def _echoes(self, req, prompts: list[list[int]], cfg) -> list[tuple[str, list]]:
        """(text, log-probabilities of its tokens or []) of each echoed prompt: the string as sent, or the
        decoded ids; the log-probabilities (the first token's None) computed by the worker when asked for."""
        one = isinstance(req.prompt, str) or isinstance(req.prompt[0], int)     # the shapes encode_completion takes
        sent = [req.prompt] if one else req.prompt
        texts = [s if isinstance(s, str) else self.sk.tokenizer.decode(ids) for s, ids in zip(sent, prompts)]
        if not cfg.wants_logprobs:
            return [(t, []) for t in texts]
        try:
            scored = await self.scheduler.score(prompts, cfg.top_logprobs, asyncio.get_running_loop())
        except Exception as err:  # noqa: BLE001
            raise ApiError(500, f"scoring the prompt failed: {err}", kind="server_error") from None
        return list(zip(texts, scored))

    async def _next(self, job: Job, request: Request) -> Item | None:
        """The job's next item; None (the job cancelled) when the client has gone."""
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.scheduler.cancel(job)
                    return None
                continue
            if item.error is not None:
                self.scheduler.cancel(job)
                if isinstance(item.error, UserError):
                    raise ApiError(400, str(item.error))
                raise ApiError(500, f"generation failed: {item.error}", kind="server_error")
            return item


class _Reply:
    def __init__(self, server: _Server, job: Job, req, chat: bool, choices: list[_Choice], prompt_tokens: int):
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
    def _feed(c: _Choice, item: Item) -> tuple[str, list]:
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

    def _logprobs(self, c: _Choice, entries: list) -> dict | None:
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

    def _message(self, c: _Choice) -> tuple[dict, str | None]:
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
        return _sse(envelope(kind, self.id, self.server.settings.model_id, [choice]))

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
                    yield _sse(ApiError(500, f"generation failed: {item.error}", kind="server_error").body())
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
                yield _sse(envelope(kind, self.id, self.server.settings.model_id, [], usage=self.usage(),
                                    spekit=self.figures()))
            yield "data: [DONE]\n\n"
        finally:
            if not self.done:                    # the client went away: stop its rows, free their slots
                self.server.scheduler.cancel(self.job)


class _Echo:
    """The answer to echo with max_tokens 0: each prompt's text and its tokens' log-probabilities, nothing
    generated."""

    def __init__(self, server: _Server, req, cfg, prompts: list[list[int]], echoes: list[tuple[str, list]]):
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


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
