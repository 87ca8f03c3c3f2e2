"""plain and one method, alternating group by group on the same prompts (so that a shared machine's drifts hit
both alike): the speedup of METHOD over plain at a batch size, with tau and greedy identity. A benchmark program,
not a test:

    python scripts/alternate.py draft --batch-size 4 --groups 8 [--draft DIR] [--dtype bfloat16] [--max-new-tokens 64]

Prompts: the first turns of every 7th Spec-Bench question (group g takes the next batch-size of them).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from spekit import SamplingConfig, Spekit
from spekit.bench.questions import load_questions
from spekit.backends.torch_models import load_model

SHIPPED_DRAFT = Path(__file__).resolve().parents[1] / "spekit" / "data" / "heads" / "smollm2-135m" / "draft"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("method")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default=str(SHIPPED_DRAFT), help="draft model for --method draft")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: ../shared/data/spec_bench)")
    args = p.parse_args()
    torch.set_num_threads(2)
    questions = [q["turns"][0] for q in load_questions(args.questions)][::7]
    plain = Spekit.load(args.model, "plain", dtype=args.dtype)
    draft = load_model(args.draft, dtype=args.dtype) if args.method == "draft" else None
    spec = plain.with_method(args.method, draft=draft)
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens)
    b = args.batch_size
    plain.generate(questions[:b], cfg)                  # warm-up (and the engines' cost calibration)
    spec.generate(questions[:b], cfg)
    seconds = {"plain": 0.0, "spec": 0.0}
    identical, taus = True, []
    for g in range(args.groups):
        prompts = questions[b * (g + 1): b * (g + 2)]
        outs = {}
        for name, sk in (("plain", plain), ("spec", spec)):
            t = time.perf_counter()
            outs[name] = sk.generate(prompts, cfg)
            seconds[name] += time.perf_counter() - t
        identical &= all(a.result.token_ids == s.result.token_ids for a, s in zip(outs["plain"], outs["spec"]))
        taus += [s.result.stats.tau for s in outs["spec"]]
    print(f"{args.method} batch {b}, {args.groups} groups: plain {seconds['plain']:.1f} s, {args.method} "
          f"{seconds['spec']:.1f} s, speedup {seconds['plain'] / seconds['spec']:.3f}x, "
          f"tau {sum(taus) / len(taus):.3f}, identical {identical}")


if __name__ == "__main__":
    main()
