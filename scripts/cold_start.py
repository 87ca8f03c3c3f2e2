"""One `spekit generate` process per prompt, as a command-line user runs it: plain and speculative methods on the
same prompts, with the step costs measured afresh in every process (`--cost-profile none`, what every process did
before spekit.pacing.profiles) and kept between processes (`--cost-profile FILE`, written by a first run). A benchmark
program, not a test:

    python scripts/cold_start.py --methods ngram,rest --prompts 8 [--dtype bfloat16] [--max-new-tokens 64]

Prompts: the first turns of every 10th Spec-Bench question. Figures: each process's own generation time (prefill,
calibration and decoding; not the model load), summed per method; the methods take turns prompt by prompt, so a
drift of the machine hits them alike. Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from spekit.bench.questions import load_questions


def generate(method: str, prompt: str, profile: str, args) -> dict:
    cmd = [sys.executable, "-m", "spekit", "generate", "--json", "--method", method, "--dtype", args.dtype,
           "--max-new-tokens", str(args.max_new_tokens), "--cost-profile", profile, prompt]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ngram,rest")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: ../shared/data/spec_bench)")
    args = p.parse_args()
    prompts = [q["turns"][0] for q in load_questions(args.questions)][::10][: args.prompts]
    methods = args.methods.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        kept = str(Path(tmp) / "costs.json")
        for method in methods:                                 # fills the profile, as a user's first run does
            generate(method, prompts[0], kept, args)
        runs = [(m, mode) for m in ["plain", *methods] for mode in ("none", kept)]
        seconds = {(m, mode): 0.0 for m, mode in runs}
        tokens, same = {}, True
        for i, prompt in enumerate(prompts):
            for m, mode in (runs if i % 2 == 0 else runs[::-1]):
                row = generate(m, prompt, mode, args)
                seconds[(m, mode)] += row["wall_s"]
                same &= tokens.setdefault(i, row["token_ids"]) == row["token_ids"]
    summary = {}
    print(f"{'method':<8} {'fresh s':>8} {'kept s':>8} {'fresh x':>8} {'kept x':>8}")
    for m in ["plain", *methods]:
        fresh, warm = seconds[(m, "none")], seconds[(m, kept)]
        row = {"fresh_s": round(fresh, 2), "kept_s": round(warm, 2),
               "fresh_speedup": round(seconds[("plain", "none")] / fresh, 3),
               "kept_speedup": round(seconds[("plain", kept)] / warm, 3)}
        summary[m] = row
        print(f"{m:<8} {fresh:8.2f} {warm:8.2f} {row['fresh_speedup']:8.3f} {row['kept_speedup']:8.3f}")
    print(json.dumps({"prompts": len(prompts), "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                      "identical": same, "methods": summary}))


if __name__ == "__main__":
    main()
