"""How much this machine's speed moves, and whether lockstep timing (`spekit bench --lockstep`) costs a method
anything. A benchmark program, not a test:

    python scripts/timing_noise.py [--dtype bfloat16] [--repeats 25] [--rounds 8]

1. The same `plain` answer (48 tokens), `--repeats` times in one process: the spread of identical work.
2. `plain` alone, then `plain` in lockstep with every other method that runs here at its defaults, alternating for
   `--rounds` prompts: plain's own time in each, so the ratio shows what running among the others costs it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from spekit import SamplingConfig, Spekit
from spekit.bench.contestants import engine_steps
from spekit.bench.lockstep import lockstep
from spekit.bench.questions import load_questions
from spekit.config import UserError
from spekit.proposers import REGISTRY


def spread(sk: Spekit, ids: list[int], repeats: int, cfg: SamplingConfig) -> None:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sk.engine.generate([ids], cfg)
        times.append(time.perf_counter() - start)
    print(f"the same answer {repeats} times: {min(times):.2f}-{max(times):.2f} s, median "
          f"{statistics.median(times):.2f} s (max / min {max(times) / min(times):.2f})")


def among_others(base: Spekit, prompts: list[list[int]], cfg: SamplingConfig) -> None:
    others = {}
    for name in sorted(REGISTRY):
        if name != "plain":
            try:
                others[name] = base.with_method(name)
            except UserError:                       # needs a draft model or a file: not here
                continue
    for sk in others.values():
        sk.engine.generate(prompts[:1], SamplingConfig(max_new_tokens=4))
    alone = together = 0.0
    for ids in prompts:
        start = time.perf_counter()
        base.engine.generate([ids], cfg)
        alone += time.perf_counter() - start
        runs = {"plain": engine_steps(base.engine)([ids], cfg)}
        runs.update({name: engine_steps(sk.engine)([ids], cfg) for name, sk in others.items()})
        together += lockstep(runs)["plain"][0].charged_s
    print(f"plain alone {alone:.2f} s; plain in lockstep with {', '.join(others)}: {together:.2f} s "
          f"(ratio {together / alone:.3f}, over {len(prompts)} prompts)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(2)
    base = Spekit.load(args.model, "plain", dtype=args.dtype)
    cfg = SamplingConfig(max_new_tokens=48)
    questions = [q["turns"][0] for q in load_questions(None)][::9]
    prompts = [base.encode(q) for q in questions[: args.rounds + 1]]
    base.engine.generate(prompts[:1], cfg)
    spread(base, prompts[0], args.repeats, cfg)
    among_others(base, prompts[1:], cfg)


if __name__ == "__main__":
    main()
