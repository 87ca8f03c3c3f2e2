"""How fast the target answers training prompts, with spekit's exact (row-invariant) forms and with the model's own
kernels (`spekit train distill --fast-answers`): greedy, batched through the engine, tokens per second per batch
size. A benchmark program, not a test:

    python scripts/distill_speed.py --dtype bfloat16 --rows 32,64,128
"""
from __future__ import annotations

import argparse
import time

from spekit import Spekit
from spekit.config import SamplingConfig
from spekit.train.distill import read_answers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--data", default="data/distill/smollm2-135m-s9", help="a distillation folder: its prompts")
    p.add_argument("--rows", default="32,64,128")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    prompts = [a["prompt_ids"] for a in read_answers(args.data) if len(a["prompt_ids"]) < 200]
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens)
    for exact in (True, False):
        sk = Spekit.load(args.model, "plain", dtype=args.dtype, exact=exact)
        for rows in [int(r) for r in args.rows.split(",")]:
            start = time.perf_counter()
            results = sk.engine.generate(prompts[:rows], cfg)
            tokens = sum(len(r.token_ids) for r in results)
            print(f"{'exact forms' if exact else 'own kernels'}  {rows:4d} rows  "
                  f"{tokens / (time.perf_counter() - start):6.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
