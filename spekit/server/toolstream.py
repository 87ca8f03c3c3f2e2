"""A streamed answer of a request with tools, as OpenAI streams one: its text goes out as content while no call
may have begun; a call's name goes out as soon as it is written (with the call's index and id, arguments ""), then
its arguments as they come; the text between calls is content again.

A call is streamed when it is written in the usual key order, `{"name": "...", "arguments": {...}}` (in a
`<tool_call>` block, or as the whole answer: a forced tool_choice, or an answer opening with `{`) and names a given
tool. Anything else that may be a call (other key order, a name not given, arguments that are not an object) is
held back and judged at the end by `tools.answer`, the same rule as an answer that is not streamed. A call whose
name went out stays a call: a stream cannot take it back, so a call cut off by max_tokens ends with its arguments
cut too (finish_reason "length").
"""
from __future__ import annotations

import uuid

import regex

from .tools import ToolUse, _calls

TAG = "<tool_call>"
# a call's opening up to its arguments' "{", after the tag; matched partially while the text is still coming
HEAD = regex.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')
TAIL = {True: regex.compile(r"\s*\}"), False: regex.compile(r"\s*\}\s*</tool_call>")}    # bare / in a block


class CallStream:
    def __init__(self, use: ToolUse):
        self.use, self.buf, self.calls = use, "", 0
        self.state = "head" if use.forced else "text"   # text | head | args | tail | hold
        self.bare = use.forced                          # the call is the whole answer, not a <tool_call> block
        self.begun = False                              # text other than white space has come
        self.depth, self.quoted, self.escaped = 0, False, False    # where the arguments' JSON is

    def feed(self, piece: str) -> list[dict]:
        """The deltas the text so far allows: {"content": ...} and {"tool_calls": [...]}."""
        self.buf += piece
        out: list[dict] = []
        while (step := getattr(self, "_" + self.state)()) is not None:
            out += step
        return out

    def end(self, finish: str | None) -> tuple[list[dict], str | None]:
        """The deltas left when the answer ends, and its finish reason ("tool_calls" once a call went out, unless
        the answer was cut)."""
        out: list[dict] = []
        if self.state == "text":
            rest = self.buf.strip() if self.calls else self.buf
            out += [{"content": rest}] if rest else []
        elif self.state in ("head", "hold"):                    # judged as a whole, as when not streamed
            content, calls = _calls(self.buf, self.use)
            if not self.use.parallel:
                calls = calls[:max(0, 1 - self.calls)]
            out += [{"content": content}] if content and content.strip() else []
            for name, args in calls:
                out.append(self._call_delta(name, args))
        elif self.state in ("args", "tail"):          # a call that went out, cut or not closed
            self.calls += 1
        self.buf = ""
        return out, "tool_calls" if self.calls and finish == "stop" else finish

    # each state: the deltas of the text it took, or None when it needs more text

    def _text(self) -> list[dict] | None:
        if not self.begun:
            if not self.buf.strip():
                return None
            self.begun = True
            if self.calls:                              # the text after a call: as `answer`, no leading space
                self.buf = self.buf.lstrip()
            elif self.buf.lstrip().startswith("{"):     # a bare call object, perhaps
                self.buf, self.state, self.bare = self.buf.lstrip(), "head", True
                return []
        if self.calls and not self.use.parallel:        # one call only: the rest is judged at the end
            self.state = "hold"
            return []
        start = self.buf.find(TAG)
        if start >= 0:
            content, self.buf, self.state, self.bare = self.buf[:start], self.buf[start:], "head", False
            return [{"content": content}] if content else []
        wait = next((k for k in range(len(TAG) - 1, 0, -1) if self.buf.endswith(TAG[:k])), 0)   # may open a tag
        content, self.buf = self.buf[:len(self.buf) - wait], self.buf[len(self.buf) - wait:]
        return [{"content": content}] if content else None

    def _head(self) -> list[dict] | None:
        text = self.buf if self.bare else self.buf[len(TAG):]
        m = HEAD.match(text, partial=True)
        if m is None or (not m.partial and m.group("name") not in self.use.names()):
            self.state = "hold"
            return []
        if m.partial:
            return None
        self.buf = text[m.end() - 1:]                   # from the arguments' "{"
        self.state, self.depth, self.quoted, self.escaped = "args", 0, False, False
        return [self._call_delta(m.group("name"), "")]

    def _args(self) -> list[dict] | None:
        for i, ch in enumerate(self.buf):
            if self.escaped:
                self.escaped = False
            elif self.quoted:
                self.escaped, self.quoted = ch == "\\", ch != '"'
            elif ch == '"':
                self.quoted = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    args, self.buf, self.state = self.buf[:i + 1], self.buf[i + 1:], "tail"
                    return [self._args_delta(args)]
        args, self.buf = self.buf, ""
        return [self._args_delta(args)] if args else None

    def _tail(self) -> list[dict] | None:
        m = TAIL[self.bare].match(self.buf, partial=True)
        if m is not None and m.partial:
            return None
        self.calls += 1
        if m is None:                                   # not closed as a call is: what follows is judged at the end
            self.state = "hold"
            return []
        self.buf, self.begun = self.buf[m.end():], False
        self.state = "hold" if self.bare else "text"    # after a bare call: judged at the end too
        return []

    def _hold(self) -> None:
        return None

    def _call_delta(self, name: str, args: str) -> dict:
        call = {"index": self.calls, "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": name, "arguments": args}}
        if self.state != "args":            # a call judged at the end: whole, and the next one gets the next index
            self.calls += 1
        return {"tool_calls": [call]}

    def _args_delta(self, args: str) -> dict:
        return {"tool_calls": [{"index": self.calls, "function": {"arguments": args}}]}
