"""Tool calling: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` on the chat endpoint, built on the chat
template and on structured output (spekit.grammar).

- The tools reach the model through its chat template when the template reads `tools` (Qwen 2.5, Llama 3.1, Hermes
  and the like). A template that does not (SmolLM2's) gets a system message that lists them and asks for calls
  written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the Hermes format many open models learnt.
  Earlier calls and their results in `messages` are written the same way.
- `tool_choice` "required" or a named function: the answer is constrained to one JSON call
  `{"name": ..., "arguments": ...}` whose arguments follow the function's `parameters` schema. Like every grammar,
  this is part of the target's distribution, so it stays lossless under every method.
- "auto" (the default when tools are given): the model answers freely; each `<tool_call>` block naming a given
  tool, or a whole answer that is one such call object, becomes an entry of `tool_calls`, and the rest stays
  `content`. "none": the tools are left out of the prompt and the answer is text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .schemas import ApiError

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)       # a block left open at the answer's end too
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict

    def spec(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def call_schema(self) -> dict:
        """The JSON schema of one call of this function."""
        return {"type": "object", "properties": {"name": {"const": self.name}, "arguments": self.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(frozen=True)
class ToolUse:
    functions: tuple[Function, ...]
    choice: str                  # "none", "auto", "required" or a function's name (a named tool_choice)
    parallel: bool = True        # parallel_tool_calls: more than one call per answer

    @property
    def active(self) -> bool:
        """The answer may hold calls (they are looked for and returned as tool_calls)."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def schema(self) -> str:
        """The grammar of a forced answer: one call of the named function, or of any of them ("required")."""
        chosen = [f for f in self.functions if self.choice in ("required", f.name)]
        one = chosen[0].call_schema() if len(chosen) == 1 else {"anyOf": [f.call_schema() for f in chosen]}
        return json.dumps(one)

    def names(self) -> set[str]:
        return {f.name for f in self.functions}


def tool_use(tools: list[Any] | None, tool_choice: Any, parallel: bool) -> ToolUse | None:
    """The request's tools and choice, checked (ApiError 400 naming the field); None when no tool is given."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return None
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise ApiError(400, "tools: two functions have the same name", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ApiError(400, 'tool_choice: give "none", "auto", "required" or {"type": "function", "function": '
                                '{"name": ...}}', "tool_choice")
        if name not in names:
            raise ApiError(400, f"tool_choice names '{name}', which is not among the tools ({', '.join(names)})",
                           "tool_choice")
        return ToolUse(functions, name, parallel)
    if choice not in ("none", "auto", "required"):
        raise ApiError(400, f"tool_choice {choice!r} is not one of none, auto, required or a named function",
                       "tool_choice")
    return ToolUse(functions, choice, parallel)


def _function(i: int, tool: Any) -> Function:
    where = f"tools.{i}"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
            not isinstance(tool.get("function"), dict):
        raise ApiError(400, f'{where}: a tool is {{"type": "function", "function": {{"name": ..., "parameters": '
                            f'{{...}}}}}}', where)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ApiError(400, f"{where}.function.name must be 1-64 letters, digits, _ or -", where)
    parameters = fn.get("parameters", ANY_OBJECT)
    if not isinstance(parameters, dict):
        raise ApiError(400, f"{where}.function.parameters must be a JSON schema (an object)", where)
    return Function(name, str(fn.get("description") or ""), parameters or ANY_OBJECT)


def reads_tools(template: str | None) -> bool:
    """Whether a chat template renders the tools itself."""
    return bool(template) and "tools" in template


def chat_messages(messages: list[dict], use: ToolUse | None, native: bool) -> tuple[list[dict], list[dict] | None]:
    """The messages and the `tools` argument for apply_chat_template. messages: {"role", "content", and for
    earlier calls "tool_calls" (assistant) or "tool_call_id" (tool)}. native: the template reads tools itself
    (`reads_tools`); else the tools go into a system message and calls and results into the text."""
    listed = use if use is not None and use.active else None
    if native:
        out = [_native(m) for m in messages]
        return out, [f.spec() for f in listed.functions] if listed else None
    out = [_written(m) for m in messages]
    if listed:
        text = _system_text(listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


def _arguments(call: dict) -> Any:
    """A call's arguments as a JSON value (OpenAI sends them as a JSON string)."""
    args = (call.get("function") or {}).get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except ValueError:
            raise ApiError(400, "messages: a tool call's arguments are not JSON", "messages") from None
    return args


def _native(m: dict) -> dict:
    if m.get("tool_calls"):
        calls = [{"type": "function", "id": c.get("id"),
                  "function": {"name": (c.get("function") or {}).get("name"), "arguments": _arguments(c)}}
                 for c in m["tool_calls"]]
        return {"role": m["role"], "content": m["content"], "tool_calls": calls}
    if m["role"] == "tool":
        return {"role": "tool", "content": m["content"], "tool_call_id": m.get("tool_call_id")}
    return {"role": m["role"], "content": m["content"]}


def _written(m: dict) -> dict:
    if m.get("tool_calls"):
        blocks = [_block({"name": (c.get("function") or {}).get("name"), "arguments": _arguments(c)})
                  for c in m["tool_calls"]]
        return {"role": m["role"], "content": "\n".join(filter(None, [m["content"], *blocks]))}
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    return {"role": m["role"], "content": m["content"]}


def _block(call: dict) -> str:
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def _system_text(use: ToolUse) -> str:
    listed = "\n".join(json.dumps(f.spec()) for f in use.functions)
    return ("You may call functions to help with the user's request. The functions:\n<tools>\n" + listed +
            "\n</tools>\nTo call one, answer with the call as JSON inside tags:\n" +
            _block({"name": "<function name>", "arguments": {"<parameter>": "<value>"}}))


def answer(text: str, finish: str | None, use: ToolUse) -> tuple[dict, str | None]:
    """A chat choice's message and finish reason for an answer of a request with tools: the calls found in it
    become tool_calls (finish "tool_calls" unless the answer was cut at max_tokens), the rest its content."""
    content, calls = _calls(text, use)
    if not use.parallel:
        calls = calls[:1]
    message: dict = {"role": "assistant", "content": content}
    if not calls:
        return message, finish
    message["tool_calls"] = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                              "function": {"name": name, "arguments": args}} for name, args in calls]
    return message, "tool_calls" if finish == "stop" else finish


def _calls(text: str, use: ToolUse) -> tuple[str | None, list[tuple[str, str]]]:
    """(the content left, [(name, arguments as a JSON string)]) of an answer."""
    whole = _call(text, use)
    if whole is not None:                     # a forced answer, or a bare call object (Llama 3.1's way)
        return None, [whole]
    calls, kept, last = [], [], 0
    for m in BLOCK.finditer(text):
        call = _call(m.group(1), use)
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:m.start()])
        last = m.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return content or None, calls


def _call(text: str, use: ToolUse) -> tuple[str, str] | None:
    """(name, arguments) when text is one JSON call of a given tool, else None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in use.names():
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args)
