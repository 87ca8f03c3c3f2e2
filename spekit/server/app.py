"""The HTTP routes. Text lives here: prompts are encoded, tokens decoded, stop sequences applied; the worker
(`scheduler.py`) sees token ids only."""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..api import Spekit
from ..config import UserError
from .guard import Guard
from .metrics import Metrics
from .scheduler import Item, Job, Scheduler
from .replies import Choice, Echo, Reply
from .schemas import ApiError, ChatRequest, CompletionRequest, parse
from .tools import ToolUse, chat_messages, reads_tools
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
    serve = Server(sk, settings, scheduler, metrics)

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


class Server:
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
            return JSONResponse(Echo(self, req, cfg, prompts, echoes).response())
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
        choices = [Choice(TextStream(self.sk.tokenizer, req.stop or [])) for _ in range(job.size)]
        for k, c in enumerate(choices if echoes else []):
            c.echo, c.echo_logprobs = echoes[k // cfg.n]
        reply = Reply(self, job, req, chat, choices, sum(len(p) for p in prompts))
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


