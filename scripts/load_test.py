"""Load test for `spekit serve` (not a unit test): N concurrent streaming chat requests through the official
openai client, some of them cut off mid-way by closing the stream; reports errors (must be 0), throughput,
latency percentiles (time to first token and total) and tau (from the server's /metrics), then checks that the
server is healthy with no rows left running.

    spekit serve --model smollm2-135m --method ngram &
    python scripts/load_test.py --streams 32 --cut 8 --max-tokens 64

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request

from openai import AsyncOpenAI

PROMPTS = [
    "Summarize in two sentences: the cache keeps keys and values of earlier tokens so that each new token "
    "attends to them without recomputing them.",
    "Write a short poem about a cat.",
    "Explain speculative decoding to a child.",
    "Translate to French: The weather is nice today and we are going to the park.",
    "List five fruits and one fact about each.",
    "What is 17 times 23? Show your steps.",
    "Rewrite this sentence in the passive voice: The engineer fixed the server.",
    "Give three tips for writing clear code.",
]


def load_prompts(path: str | None, count: int) -> list[str]:
    if not path:
        return [PROMPTS[i % len(PROMPTS)] for i in range(count)]
    with open(path) as f:
        questions = [json.loads(line)["turns"][0] for line in f if line.strip()]
    step = max(1, len(questions) // count)           # spread over the categories
    return [questions[(i * step) % len(questions)] for i in range(count)]


def scrape(base: str, key: str | None) -> dict[str, float]:
    req = urllib.request.Request(base.removesuffix("/v1") + "/metrics",
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    totals: dict[str, float] = {}
    with urllib.request.urlopen(req, timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("spekit_") and not line.startswith("#"):
                name = line.split("{")[0].split(" ")[0]
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def health(base: str) -> dict:
    with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=30) as response:
        return json.loads(response.read())


async def one(client: AsyncOpenAI, model: str, prompt: str, max_tokens: int, cut_after: int | None) -> dict:
    start = time.perf_counter()
    out = {"ttft": None, "tokens": 0, "cut": cut_after is not None, "error": None}
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        pieces = 0
        async for chunk in stream:
            if chunk.usage is not None:
                out["tokens"] = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                pieces += 1
                if out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - start
                if cut_after is not None and pieces >= cut_after:
                    out["tokens"] = pieces                  # at least this many tokens came
                    await stream.close()                    # hang up mid-stream
                    break
    except Exception as err:                                # noqa: BLE001 - every failure is a reported error
        out["error"] = f"{type(err).__name__}: {err}"
    out["total"] = time.perf_counter() - start
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else float("nan")


async def main(args) -> dict:
    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none", max_retries=0, timeout=600)
    model = args.model or (await client.models.list()).data[0].id
    prompts = load_prompts(args.questions, args.streams)
    before = scrape(args.base_url, args.api_key)
    start = time.perf_counter()
    every = args.streams // args.cut if args.cut else 0          # cut streams spread over the batch
    cuts = [args.cut_after if every and i % every == 0 and i // every < args.cut else None
            for i in range(args.streams)]
    results = await asyncio.gather(*(one(client, model, p, args.max_tokens, c) for p, c in zip(prompts, cuts)))
    wall = time.perf_counter() - start
    after = scrape(args.base_url, args.api_key)
    for _ in range(100):                                    # cut streams leave at the next step boundary
        if health(args.base_url)["running_rows"] == 0:
            break
        await asyncio.sleep(0.1)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    done = [r for r in results if not r["cut"] and r["error"] is None]
    tokens = sum(r["tokens"] for r in results if r["error"] is None)
    report = {
        "streams": args.streams, "cut": sum(r["cut"] for r in results), "max_tokens": args.max_tokens,
        "errors": sum(r["error"] is not None for r in results),
        "error_samples": [r["error"] for r in results if r["error"]][:3],
        "wall_s": round(wall, 2), "completion_tokens": tokens, "throughput_tok_s": round(tokens / wall, 2),
        "ttft_s": {f"p{q}": round(pct([r["ttft"] for r in results if r["ttft"]], q), 3) for q in (50, 90, 99)},
        "total_s": {f"p{q}": round(pct([r["total"] for r in done], q), 3) for q in (50, 90, 99)},
        "tau": round(delta.get("spekit_generated_tokens_total", 0)
                     / max(delta.get("spekit_target_forwards_total", 0), 1), 3),
        "mean_batch_rows": round(delta.get("spekit_step_batch_size_sum", 0)
                                 / max(delta.get("spekit_step_batch_size_count", 0), 1), 2),
        "healthy_after": health(args.base_url)["status"] == "ok",
        "rows_left_running": health(args.base_url)["running_rows"],
    }
    print(f"streams {report['streams']} ({report['cut']} cut mid-way), max_tokens {args.max_tokens}: "
          f"errors {report['errors']}, {tokens} tokens in {wall:.1f} s = {report['throughput_tok_s']} tok/s, "
          f"tau {report['tau']}, mean rows per step {report['mean_batch_rows']}")
    print(f"TTFT p50/p90/p99 {report['ttft_s']['p50']}/{report['ttft_s']['p90']}/{report['ttft_s']['p99']} s; "
          f"total p50/p90/p99 {report['total_s']['p50']}/{report['total_s']['p90']}/{report['total_s']['p99']} s")
    print(json.dumps(report))
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model id (default: the server's)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--cut", type=int, default=8, help="streams closed by the client mid-way")
    p.add_argument("--cut-after", type=int, default=5, help="content chunks a cut stream reads before hanging up")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (first turns); default: built-in")
    return p.parse_args(argv)


if __name__ == "__main__":
    report = asyncio.run(main(parse_args()))
    raise SystemExit(1 if report["errors"] or report["rows_left_running"] else 0)
