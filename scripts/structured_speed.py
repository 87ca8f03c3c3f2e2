"""Structured output's speed: the same JSON schema on six extraction prompts, `plain` and each method in turn per
prompt (so slow drift of the machine meets every method alike); checks that every answer equals `plain`'s and
parses. With --tools: six weather questions answered by a forced call of a `get_weather` tool, the prompt and the
grammar built as the server builds them (spekit.server.tools). A benchmark program, not a test:

    python scripts/structured_speed.py [--tools] [--dtype bfloat16] [--methods ngram,rest,eagle3-lookup,eagle3]
"""
from __future__ import annotations

import argparse
import json
import time

from spekit import SamplingConfig, Spekit

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60},
    "people": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    "places": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    "date": {"type": "string", "maxLength": 30},
    "summary": {"type": "string", "maxLength": 200}},
    "required": ["title", "people", "places", "date", "summary"], "additionalProperties": False}
TEXTS = [
    "On March 3, Maria Lopez and Tom Becker opened a bakery in Lyon after years of working in Paris restaurants.",
    "The city council of Springfield met on Tuesday, June 4, with Mayor Ann Reed, to approve the new park budget.",
    "Dr. Kenji Sato presented his research on coral reefs at the Sydney conference on 12 October 2024.",
    "In 1969 Neil Armstrong and Buzz Aldrin landed on the Moon while Michael Collins orbited above.",
    "Last Friday, the Berlin orchestra, led by conductor Eva Klein, played a free concert in the Tiergarten.",
    "Priya Patel and her brother Arjun walked from Mumbai to Pune in August to raise money for a school.",
]
PROMPTS = [f"Extract the facts of this text as JSON (title, people, places, date, summary).\n\n{t}" for t in TEXTS]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
QUESTIONS = ["What's the weather like in Paris today, in celsius?", "Is it cold in Oslo right now? Fahrenheit please.",
             "Tell me the temperature in Buenos Aires in celsius.", "How warm is it in Tokyo? Use fahrenheit.",
             "Should I take a coat in Chicago today? Celsius.", "What is the weather in Cape Town, in fahrenheit?"]


def tool_prompts(sk: Spekit) -> tuple[list, str]:
    """The weather questions as the server renders them with a forced get_weather call, and that call's grammar."""
    from spekit.server.tools import chat_messages, reads_tools, tool_use
    use = tool_use([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, True)
    native = reads_tools(sk.tokenizer.chat_template)
    prompts = [chat_messages([{"role": "user", "content": q}], use, native)[0] for q in QUESTIONS]
    if native:
        raise SystemExit("this script renders tools as a system message; the model's template reads them itself")
    return prompts, use.schema()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--methods", default="ngram,rest,eagle3-lookup,eagle3")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--tools", action="store_true", help="forced tool calls instead of the extraction schema")
    args = ap.parse_args()
    base = Spekit.load(args.model, dtype=args.dtype)
    methods = ["plain", *args.methods.split(",")]
    runs = {m: base if m == "plain" else base.with_method(m) for m in methods}
    prompts, schema = tool_prompts(base) if args.tools else (PROMPTS, json.dumps(SCHEMA))
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, json_schema=schema)
    for sk in runs.values():                                   # warm-up: the grammar, the costs, the heads
        sk.generate([prompts[0]], SamplingConfig(max_new_tokens=8, json_schema=cfg.json_schema))
    totals = {m: [0, 0.0, 0] for m in methods}                 # tokens, seconds, target forwards
    for prompt in prompts:
        want = None
        for m in methods:
            t0 = time.perf_counter()
            [g] = runs[m].generate([prompt], cfg)
            seconds = time.perf_counter() - t0
            r = g.result
            totals[m][0] += len(r.token_ids)
            totals[m][1] += seconds
            totals[m][2] += r.stats.target_forwards
            if want is None:
                want = r.token_ids
                if r.finish_reason == "stop":
                    json.loads(g.text)
                print(r.finish_reason, g.text)
            assert r.token_ids == want, f"{m} differs from plain"
    rate = totals["plain"][0] / totals["plain"][1]
    for m, (tokens, seconds, forwards) in totals.items():
        print(f"{m:14s} {tokens} tokens  {tokens / seconds:5.1f} tok/s  {tokens / seconds / rate:.2f}x  "
              f"tau {tokens / forwards:.2f}")


if __name__ == "__main__":
    main()
