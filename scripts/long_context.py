"""Long prompts: plain and methods on RAG-style prompts of about --tokens tokens (Spec-Bench RAG passages joined
until long enough), greedy, batch 1. Prints per method the whole-answer and decode-only rates (prefill left
out: it is the same forward for every method), tau and greedy identity with plain. A benchmark program, not a
test:

    python scripts/long_context.py --tokens 3500 --methods plain,ngram,rest,lookahead [--dtype bfloat16] [--prompts 2]

--blind adds, for each method, the same method with a context-blind cost model (every step timed and sized as if
over at most 512 keys, as before step costs were kept per context bucket), run alternately with the others.
"""
from __future__ import annotations

import argparse
import time

import torch

from spekit.pacing import governor, priors, step_costs
from spekit import SamplingConfig, Spekit
from spekit.bench.questions import encode_turn, load_questions, pick


def long_prompts(tokenizer, questions: list[dict], tokens: int, count: int) -> list[list[int]]:
    """`count` chat prompts of at least `tokens` tokens, each the RAG questions from a different start joined."""
    out = []
    for i in range(count):
        text, j = "", 0
        while len(tokenizer(text)["input_ids"]) < tokens:
            text += questions[(i * 5 + j) % len(questions)]["turns"][0] + "\n\n"
            j += 1
        out.append(encode_turn(tokenizer, [{"role": "user", "content": text}], True))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=3500)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--methods", default="plain,ngram,rest,lookahead")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: ../shared/data/spec_bench)")
    p.add_argument("--blind", action="store_true", help="also each method with a context-blind cost model")
    args = p.parse_args()
    real_bucket, blind = priors.context_bucket, {"on": False}
    for module in (priors, step_costs, governor):       # every reader of the context bucket
        module.context_bucket = lambda keys: 512 if blind["on"] else real_bucket(keys)
    torch.set_num_threads(2)
    methods = args.methods.split(",")
    if methods[0] != "plain":
        methods = ["plain"] + [m for m in methods if m != "plain"]
    plain = Spekit.load(args.model, "plain", dtype=args.dtype)
    prompts = long_prompts(plain.tokenizer, pick(load_questions(args.questions), 10, ["rag"]), args.tokens,
                           args.prompts)
    engines = {m: plain.with_method(m).engine if m != "plain" else plain.engine for m in methods}
    if args.blind:
        engines.update({f"{m} (blind)": plain.with_method(m).engine for m in methods if m != "plain"})
    for name, engine in engines.items():                                  # first forwards and cost calibration
        blind["on"] = name.endswith("(blind)")
        engine.generate([prompts[0][:200]], SamplingConfig(max_new_tokens=8))
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens)
    totals = {m: [0.0, 0.0, 0, 0, 0, 0] for m in engines}   # seconds, decode seconds, tokens, forwards, same, answers
    reference: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        for m, engine in engines.items():
            blind["on"] = m.endswith("(blind)")
            t = time.perf_counter()
            [r] = engine.generate([prompt], cfg)
            seconds = time.perf_counter() - t
            if m == "plain":
                reference.append(r.token_ids)
            tot = totals[m]
            tot[0] += seconds
            tot[1] += seconds - r.stats.prefill_s
            tot[2] += len(r.token_ids)
            tot[3] += r.stats.target_forwards
            tot[4] += r.token_ids == reference[i]
            tot[5] += 1
    print(f"{args.prompts} prompts of {', '.join(str(len(p)) for p in prompts)} tokens, {args.dtype}, "
          f"{args.max_new_tokens} new tokens")
    base = totals["plain"]
    for m, (s, d, n, f, same, k) in totals.items():
        print(f"{m:20s} {n / s:6.2f} tok/s ({base[0] / s:.2f}x)  decode-only {n / d:6.2f} tok/s "
              f"({base[1] / d:.2f}x)  tau {n / max(f, 1):.2f}  identical {same}/{k}")


if __name__ == "__main__":
    main()
