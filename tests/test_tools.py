"""Tool calling's text side (spekit.server.tools), without a model: requests are checked, tools reach the prompt
(through a template that reads them, or a system message), earlier calls and results are written back, answers
are split into content and calls, and a forced tool_choice becomes the grammar of one call."""
from __future__ import annotations

import json

import llguidance
import pytest

from spekit.server.schemas import ApiError
from spekit.server.tools import CallStream, answer, chat_messages, reads_tools, tool_use

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_choices_and_their_errors():
    assert tool_use(None, None, True) is None
    auto = tool_use([WEATHER, TIME], None, True)
    assert auto.choice == "auto" and auto.active and not auto.forced
    assert tool_use([WEATHER], "none", True).active is False
    named = tool_use([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, True)
    assert named.forced and named.choice == "get_time"
    assert tool_use([TIME], None, True).functions[0].parameters == {"type": "object"}
    for tools, choice, words in [
            ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
            ([WEATHER], "sometimes", "not one of"),
            ([WEATHER], {"type": "function"}, "tool_choice: give"),
            (None, "required", "needs tools"),
            ([{"type": "function", "function": {"name": "bad name!"}}], None, "letters, digits"),
            ([{"type": "retrieval"}], None, "a tool is"),
            ([WEATHER, WEATHER], None, "same name"),
            ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "JSON schema")]:
        with pytest.raises(ApiError) as err:
            tool_use(tools, choice, True)
        assert err.value.status == 400 and words in err.value.message


def test_forced_schema_is_one_call_of_the_chosen_function():
    named = json.loads(tool_use([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}},
                                True).schema())
    assert named["properties"]["name"] == {"const": "get_weather"}
    assert named["properties"]["arguments"] == WEATHER["function"]["parameters"]
    required = json.loads(tool_use([WEATHER, TIME], "required", True).schema())
    assert [s["properties"]["name"]["const"] for s in required["anyOf"]] == ["get_weather", "get_time"]
    for schema in (named, required):     # llguidance compiles both
        llguidance.LLMatcher.grammar_from_json_schema(schema)


def test_tools_reach_the_prompt_and_history_is_written_back():
    use = tool_use([WEATHER], "auto", True)
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"}]
    turns, tools = chat_messages(history, use, native=False)
    assert tools is None and turns[0]["role"] == "system" and '"get_weather"' in turns[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' == \
        turns[2]["content"]
    assert turns[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
    own = chat_messages([{"role": "system", "content": "Be brief."}, *history[:1]], use, native=False)[0]
    assert own[0]["content"].startswith("Be brief.\n\n") and len(own) == 2
    turns, tools = chat_messages(history, use, native=True)
    assert tools == [WEATHER] and turns[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert turns[2] == {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"}
    assert chat_messages(history[:1], tool_use([WEATHER], "none", True), native=False)[0] == history[:1]
    assert reads_tools("{% if tools %}{{ tools }}{% endif %}") and not reads_tools("{{ messages }}")
    with pytest.raises(ApiError, match="not JSON"):
        chat_messages([{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": "{oops"}}]}], use, native=False)


def test_answers_split_into_content_and_calls():
    use = tool_use([WEATHER, TIME], "auto", True)
    message, finish = answer('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                             '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}', "stop", use)
    assert finish == "tool_calls" and message["content"] == "Let me look."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert calls == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    bare, finish = answer('{"name": "get_time", "parameters": {"zone": "UTC"}}', "stop", use)   # Llama 3.1's way
    assert bare["content"] is None and json.loads(bare["tool_calls"][0]["function"]["arguments"]) == {"zone": "UTC"}
    text = '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call> no'      # not a given tool: text
    assert answer(text, "stop", use) == ({"role": "assistant", "content": text}, "stop")
    cut = answer('{"name": "get_weather", "arguments": {"ci', "length", use)
    assert cut == ({"role": "assistant", "content": '{"name": "get_weather", "arguments": {"ci'}, "length")
    one = answer('<tool_call>{"name": "get_time"}</tool_call><tool_call>{"name": "get_time"}</tool_call>', "stop",
                 tool_use([TIME], "auto", False))[0]
    assert len(one["tool_calls"]) == 1


def _streamed(use, pieces: list[str], finish: str = "stop") -> tuple[str, dict, str]:
    calls = CallStream(use)
    sent = "".join(calls.feed(p) for p in pieces)
    message, why = calls.end(finish)
    return sent, message, why


def test_streamed_answers_send_text_until_a_call_may_begin():
    use = tool_use([WEATHER, TIME], "auto", True)
    sent, message, why = _streamed(use, ["It is ", "a <b>fine</b> day", " <", "tool_c"])
    assert sent == "It is a <b>fine</b> day " and message["content"] == "<tool_c" and why == "stop"
    pieces = ["Let me look.\n<tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>']
    sent, message, why = _streamed(use, pieces)
    assert sent == "Let me look.\n" and message["content"] is None and why == "tool_calls"
    assert message["tool_calls"][0]["function"]["name"] == "get_time"
    sent, message, why = _streamed(use, ["  {", '"name": "get_time"}'])           # a bare call: held from "{"
    assert sent == "" and len(message["tool_calls"]) == 1
    sent, message, why = _streamed(use, ['{"not": ', '"a call"}'])
    assert sent == "" and message == {"role": "assistant", "content": '{"not": "a call"}'} and why == "stop"
    forced = tool_use([TIME], "required", True)
    sent, message, why = _streamed(forced, ['{"name": "get_time", "arguments": {}}'])
    assert sent == "" and why == "tool_calls"
