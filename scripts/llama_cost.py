"""What a verification forward over k new tokens costs against a one-token step on the llama.cpp backend, and what
changes it: the kernels (exact: spekit's default; fast: llama.cpp's defaults), logits at every token (what
verification needs) or only at the last one (what a prompt needs), and the thread count.

    python scripts/llama_cost.py [--model smollm2-135m] [--context 400] [--repeats 9] [--threads 0]
    python scripts/llama_cost.py --prefill [--model M] [--repeats 3]

Prints, per setting, the median milliseconds of a decode over k = 1, 2, 4, 8, 12, 16, 24, 32 new tokens after a
context of --context tokens, and each relative to one token; every decode is rolled back, so each sees the same
cache, and the widths take turns, so that a slow spell of the machine hits them all. Then whether this llama.cpp
rounds wide forwards as one-token ones (backends.llama_lib.rounding_apart) and its build flags.

With --prefill: the seconds a prompt of 100 to 1500 tokens takes with the exact kernels and with the fast prefill
(`--prefill-kernels`: flash attention and repacked weights in a second context, the cache moved into the exact
one), the best of --repeats, the two taking turns.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from spekit.backends.llama_model import LlamaModel, LlamaSettings
from spekit.backends.llama_cpp import LlamaTarget
from spekit.backends.llama_lib import lib, rounding_apart
from spekit.backends.loading import gguf_file, gguf_source
from spekit.config import UserError

WIDTHS = (1, 2, 4, 8, 12, 16, 24, 32)


def timed(target: LlamaTarget, kv, context: int, n: int, last_only: bool) -> float:
    """Seconds of one decode over n new tokens (a chain), rolled back."""
    start = kv.length
    positions = torch.arange(n)[None] + context                                          # [1, n]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None]                               # [1, n, n]
    t = time.perf_counter()
    target.forward(kv, torch.full((1, n), 5), positions, mask, last_only=last_only)
    seconds = time.perf_counter() - t
    kv.keep(start, torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    return seconds


def curve(path: str, settings: LlamaSettings, last_only: bool, context: int, repeats: int) -> dict[int, float]:
    target = LlamaTarget(LlamaModel(path, settings), settings, cost_profile="none")
    kv, _, _ = target.prefilled([[100 + i % 1000 for i in range(context)]], max(WIDTHS) + 1)
    for n in WIDTHS:                                  # warm-up
        timed(target, kv, context, n, last_only)
    runs = {n: [] for n in WIDTHS}
    for _ in range(repeats):
        for n in WIDTHS:
            runs[n].append(timed(target, kv, context, n, last_only))
    kv.release()
    return {n: statistics.median(v) for n, v in runs.items()}


PROMPTS = (100, 300, 700, 1500)


def prefill_times(path: str, threads: int, repeats: int) -> None:
    made = {name: LlamaSettings(ctx_size=max(PROMPTS) + 64, threads=threads, prefill=name)
            for name in ("exact", "fast")}
    targets = {name: LlamaTarget(LlamaModel(path, s), s, cost_profile="none") for name, s in made.items()}
    print(f"{'prompt tokens':<16}{'exact (s)':>12}{'fast (s)':>12}{'fast/exact':>12}")
    for n in PROMPTS:
        prompt = [100 + (37 * i) % 5000 for i in range(n)]
        best = {}
        for round_ in range(repeats + 1):          # the first round loads the fast context: not counted
            for name, target in targets.items():
                t = time.perf_counter()
                kv, _, _ = target.prefilled([prompt], 1)
                seconds = time.perf_counter() - t
                kv.release()
                target.drop_prefixes()
                if round_:
                    best[name] = min(best.get(name, seconds), seconds)
        print(f"{n:<16}{best['exact']:>12.3f}{best['fast']:>12.3f}{best['fast'] / best['exact']:>12.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0, help="0: every core (and one thread as a second setting)")
    ap.add_argument("--prefill", action="store_true", help="time prompts: the exact kernels against the fast prefill")
    args = ap.parse_args(argv)
    try:
        if args.prefill:
            if args.repeats < 1:
                raise UserError("--repeats must be >= 1")
            print(f"{args.model} on llama.cpp: prompts, best of {args.repeats}")
            prefill_times(gguf_file(gguf_source(args.model)), args.threads, args.repeats)
            return 0
        if args.context < 1 or args.repeats < 1:
            raise UserError("--context and --repeats must be >= 1")
        path = gguf_file(gguf_source(args.model))
        ctx = args.context + max(WIDTHS) + 16
        base = LlamaSettings(ctx_size=ctx, threads=args.threads)
        forms = {"exact, every logit": (base, False), "exact, last logit": (base, True),
                 "fast, every logit": (LlamaSettings(ctx_size=ctx, threads=args.threads, kernels="fast"), False)}
        if args.threads == 0:
            forms["exact, 1 thread"] = (LlamaSettings(ctx_size=ctx, threads=1), False)
        print(f"{args.model} on llama.cpp, {base.cores()} threads, context {args.context}: ms per decode (relative "
              "to 1 token)")
        print(f"{'setting':<20}" + "".join(f"{n:>14}" for n in WIDTHS))
        for name, (settings, last_only) in forms.items():
            got = curve(path, settings, last_only, args.context, args.repeats)
            print(f"{name:<20}" + "".join(f"{1000 * got[n]:8.2f} ({got[n] / got[1]:.2f})" for n in WIDTHS))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    apart = rounding_apart()
    print("wide forwards round as one-token ones with the exact kernels" if not apart else
          "wide forwards round otherwise: " + "; ".join(apart))
    print(lib().llama_print_system_info().decode().strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
