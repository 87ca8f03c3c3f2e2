"""Tool calling's text side (spekit.server.tools), without a model: requests are checked, tools reach the prompt
(through a template that reads them, or a system message), earlier calls and results are written back, answers
are split into content and calls, and a forced tool_choice becomes the grammar of one call."""
from __future__ import annotations

import json

import llguidance
import pytest

from spekit.server.schemas import ApiError
from spekit.server.tools import answer, chat_messages, reads_tools, tool_use
from spekit.server.toolstream import CallStream

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


def _streamed(use, pieces: list[str], finish: str = "stop") -> tuple[str, list[tuple[str, str]], str, list[dict]]:
    """(the content sent, the calls as (name, arguments) put together from their deltas, the finish reason, every
    delta) of an answer streamed in these pieces."""
    stream = CallStream(use)
    deltas = [d for p in pieces for d in stream.feed(p)]
    rest, why = stream.end(finish)
    deltas += rest
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for call in d.get("tool_calls", []):
            if "id" in call:
                assert call["index"] not in calls and call["id"].startswith("call_")
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[k]) for k in sorted(calls)], why, deltas


def test_streamed_answers_send_text_until_a_call_may_begin():
    use = tool_use([WEATHER, TIME], "auto", True)
    content, calls, why, deltas = _streamed(use, ["It is ", "a <b>fine</b> day", " <", "tool_c"])
    assert content == "It is a <b>fine</b> day <tool_c" and calls == [] and why == "stop"
    assert deltas[-1] == {"content": "<tool_c"}                   # what may open a tag waits for the end
    pieces = ["Let me look.\n<tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>']
    content, calls, why, _ = _streamed(use, pieces)
    assert content == "Let me look.\n" and calls == [("get_time", "{}")] and why == "tool_calls"
    content, calls, why, _ = _streamed(use, ["  {", '"name": "get_time"}'])      # no arguments: judged at the end
    assert content == "" and calls == [("get_time", "{}")]
    content, calls, why, _ = _streamed(use, ['{"not": ', '"a call"}'])
    assert content == '{"not": "a call"}' and calls == [] and why == "stop"
    forced = tool_use([TIME], "required", True)
    content, calls, why, _ = _streamed(forced, ['{"name": "get_time", "arguments": {}}'])
    assert content == "" and calls == [("get_time", "{}")] and why == "tool_calls"


def test_a_calls_name_goes_out_first_then_its_arguments_as_they_come():
    use = tool_use([WEATHER, TIME], "auto", True)
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo {\\"} x"}}\n</tool_call>'
    content, calls, why, deltas = _streamed(use, list(text))          # one character at a time
    assert content == "Sure.\n" and calls == [("get_weather", '{"city": "Oslo {\\"} x"}')] and why == "tool_calls"
    kinds = ["content" if "content" in d else "id" if "id" in d["tool_calls"][0] else "args" for d in deltas]
    first_args = kinds.index("args")
    assert kinds.index("id") < first_args and kinds.count("args") == len('{"city": "Oslo {\\"} x"}')
    assert "content" not in kinds[first_args:]
    cut = _streamed(use, ['<tool_call>{"name": "get_weather", "arguments": {"ci'], "length")   # at max_tokens
    assert cut[1:3] == ([("get_weather", '{"ci')], "length")      # a name that went out stays a call


TEXTS = ['Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone.',
         '{"name": "get_time", "parameters": {"zone": "UTC"}}',
         '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>',       # other key order
         '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call> no',
         '<tool_call>{"name": "get_weather", "arguments": {"city": [1, {"a": "]}"}]}}</tool_call>',
         'plain text, no call at all {"x": 1}', '  \n ', '']


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_or_not_an_answer_has_the_same_content_and_calls(text, parallel):
    import random
    use = tool_use([WEATHER, TIME], "auto", parallel)
    message, finish = answer(text, "stop", use)
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        content, calls, why, _ = _streamed(use, pieces)
        assert [(n, json.loads(a)) for n, a in calls] == want and why == finish
        assert content.split() == (message["content"] or "").split()     # the same text, up to white space
