"""OpenAI request shapes (validated with pydantic) and the response, chunk and error objects."""
from __future__ import annotations

import json
import random
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..config import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingConfig, UserError


class ApiError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class SpekitExtra(BaseModel):
    """The extra body field {"spekit": {"method": "ngram", "options": {"num_draft_tokens": 8}, "regex": "...",
    "verification": "token", "relaxed": 1.0}} (regex: the answer matches it, as vLLM's guided_regex;
    verification and relaxed: SamplingConfig's, relaxed being the opt-in LOSSY rule)."""
    model_config = ConfigDict(extra="forbid")
    method: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    regex: str | None = None
    verification: Literal["block", "token"] = "block"
    relaxed: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)            # vLLM's: no EOS / stop token before this many tokens
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)                 # beyond OpenAI, as vLLM takes them
    min_p: float = Field(default=0.0, ge=0, lt=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    n: int = Field(default=1, ge=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)     # OpenAI's range
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None                       # {"token id": bias in [-100, 100]}
    # asked for, not served: refused (see unsupported) rather than ignored, since ignoring them changes the answer
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    spekit: SpekitExtra | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, bias in (v or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"keys are token ids, got '{key}'")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"biases are in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
        return v

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(b)) for k, b in (self.logit_bias or {}).items()))

    def unsupported(self) -> None:
        """Refuse what the request asks for and this server does not do: answering without it would be a
        different answer than the client asked for. Tools are served on the chat endpoint (ChatRequest)."""
        if self.functions:
            raise ApiError(400, "functions (OpenAI's deprecated form) is not supported: give tools", "functions")
        self.check_tools()
        self.grammar()

    def check_tools(self) -> None:
        """Tools where they are not served (the chat request serves them)."""
        if self.tools or self.tool_choice == "required" or isinstance(self.tool_choice, dict):
            raise ApiError(400, "tool calling is served on /v1/chat/completions", "tools")

    def grammar(self) -> tuple[str, str]:
        """(json_schema, regex) of SamplingConfig from response_format ("json_object": any JSON object;
        "json_schema": its json_schema.schema) and spekit.regex."""
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        schema = ""
        if kind == "json_object":
            schema = '{"type": "object"}'
        elif kind == "json_schema":
            inner = fmt.get("json_schema")
            if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), (dict, bool)):
                raise ApiError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                                    "\"schema\": {...}}}", "response_format")
            schema = json.dumps(inner.get("schema", {}))
        elif kind != "text":
            raise ApiError(400, f"response_format {kind!r} is not supported by this server (text, json_object, "
                                "json_schema)", "response_format")
        regex = (self.spekit.regex if self.spekit else None) or ""
        if self.spekit and self.spekit.regex == "":
            raise ApiError(400, "spekit.regex is empty: give a pattern, or leave regex out", "spekit")
        if schema and regex:
            raise ApiError(400, "give response_format or spekit.regex, not both", "response_format")
        return schema, regex

    def logprob_settings(self) -> tuple[bool, int]:
        """(log-probabilities wanted, how many top tokens with each)."""
        return False, 0

    def sampling(self, default_max: int, server_max: int) -> SamplingConfig:
        wanted = self.max_completion_tokens or self.max_tokens or default_max
        if wanted > server_max:
            raise ApiError(400, f"max_tokens is {wanted}, this server allows at most {server_max}", "max_tokens")
        if self.min_tokens > wanted:
            raise ApiError(400, f"min_tokens ({self.min_tokens}) is more than max_tokens ({wanted})", "min_tokens")
        seed = self.seed if self.seed is not None else random.getrandbits(63)
        schema, regex = self.grammar()
        extra = self.spekit or SpekitExtra()
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, logit_bias=self.bias_pairs(),
                              max_new_tokens=wanted, min_new_tokens=self.min_tokens, seed=seed,
                              n=self.n, logprobs=self.logprob_settings()[0], top_logprobs=self.logprob_settings()[1],
                              json_schema=schema, regex=regex, verification=extra.verification,
                              relaxed=extra.relaxed)


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)     # the legacy API: this many top tokens as well
    max_tokens: int | None = Field(default=None, ge=0)         # 0: score the echoed prompt, write nothing

    @property
    def score_only(self) -> bool:
        """echo with max_tokens 0: the prompt's own log-probabilities, nothing generated (how evaluation harnesses
        ask for a text's likelihood)."""
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens must be >= 1 (0 only with echo, to score the prompt)", "max_tokens")
        return self.max_tokens == 0

    def logprob_settings(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    tool_calls: list[dict[str, Any]] | None = None      # an assistant's earlier calls (spekit.server.tools)
    tool_call_id: str | None = None                     # a tool's result: the call it answers

    def turn(self) -> dict:
        """The message as chat templates (and spekit.server.tools) take it."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise ApiError(400, "only text content parts are supported", "messages")
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content or ""


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    parallel_tool_calls: bool = True

    def tool_use(self):
        """The request's tools and tool_choice, checked (spekit.server.tools.ToolUse), or None without tools."""
        from .tools import tool_use
        return tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)

    def check_tools(self) -> None:
        self.tool_use()

    def grammar(self) -> tuple[str, str]:
        """As for any request, and with tool_choice "required" or a named function: the grammar of one call."""
        schema, regex = super().grammar()
        use = self.tool_use()
        if use is None or not use.forced:
            return schema, regex
        if schema or regex:
            raise ApiError(400, "a forced tool_choice constrains the answer already: give it or response_format / "
                                "spekit.regex, not both", "tool_choice")
        return use.schema(), ""

    def logprob_settings(self) -> tuple[bool, int]:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return self.logprobs, self.top_logprobs or 0


def parse(cls, data: Any):
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field. Strict, as OpenAI's API:
    a string, a bool or a decimal where a number or an integer goes is refused, not converted ("4", true, 4.0 for
    max_tokens); an integer where a number goes is a number."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(data, strict=True)
    except ValidationError as err:
        first = err.errors()[0]
        # the field's place without pydantic's names of union branches ("prompt.str", "stop.list[str]")
        param = ".".join(str(p) for p in first["loc"] if not _branch(p)) or None
        msg = first["msg"].removeprefix("Value error, ")
        if param == "prompt" and first["type"] != "value_error":       # every branch of its union failed
            msg = "must be a string, a list of strings, a list of token ids, or a list of lists of token ids"
        raise ApiError(400, f"{param}: {msg}" if param else msg, param) from None
    except UserError as err:
        raise ApiError(400, str(err)) from None


def _branch(part) -> bool:
    """Whether a part of a pydantic error's location names a branch of a union type rather than a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict") or "[" in part)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, rid: str, model: str, choices: list[dict], **extra) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}
