"""What a verification forward over n new tokens costs against a one-token step, in spekit's row-invariant forms
(exact: every row rounds as a plain step would) and in the model's own kernels (what Hugging Face's `generate`
runs: faster for wide forwards, but a row of an n-token forward may round otherwise than the same token alone).

    python scripts/verify_cost.py [--model smollm2-135m] [--dtype bfloat16] [--context 400] [--repeats 7]

Prints, per form, the median milliseconds of a forward over 1, 2, 4, 8, 12, 16, 24 and 32 new tokens after a
context of --context tokens, and each relative to one token. The forwards are rolled back, so every one sees
the same cache.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from spekit.config import UserError
from spekit.backends.torch_models import load_model
from spekit.backends.torch_target import Target

WIDTHS = (1, 2, 4, 8, 12, 16, 24, 32)


def timed(target: Target, kv, context: int, n: int) -> float:
    """Seconds of one forward over n new tokens (a causal chain), rolled back."""
    start = kv.length
    positions = torch.arange(n, device=target.device)[None] + context                  # [1, n]
    mask = torch.ones(n, n, dtype=torch.bool, device=target.device).tril()[None]        # [1, n, n]
    t = time.perf_counter()
    logits, _ = target.forward(kv, torch.full((1, n), 5, device=target.device), positions, mask)
    logits.argmax(-1).tolist()                                                          # wait for the device
    seconds = time.perf_counter() - t
    kv.keep(start, torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    return seconds


def curve(model, exact: bool, context: int, repeats: int) -> dict[int, float]:
    target = Target(model, exact=exact, cost_profile="none")
    kv, _, _ = target.prefilled([[100 + i % 1000 for i in range(context)]], max(WIDTHS) + 1)
    for n in WIDTHS:                      # warm-up: the first forward of a shape sets up its kernels
        timed(target, kv, context, n)
    runs = {n: [] for n in WIDTHS}
    for _ in range(repeats):              # interleaved, so that a slow spell of the machine hits every width
        for n in WIDTHS:
            runs[n].append(timed(target, kv, context, n))
    return {n: statistics.median(v) for n, v in runs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    if args.context < 1 or args.repeats < 1:
        print("error: --context and --repeats must be >= 1", file=sys.stderr)
        return 2
    try:
        # one copy per form: the row-invariant forms are switched on in place
        forms = {"exact (spekit)": load_model(args.model, dtype=args.dtype).model,
                 "own kernels (HF)": load_model(args.model, dtype=args.dtype).model}
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.model} {args.dtype}, context {args.context}: ms per forward (relative to 1 token)")
    print(f"{'form':<18}" + "".join(f"{n:>14}" for n in WIDTHS))
    for name, model in forms.items():
        got = curve(model, name.startswith("exact"), args.context, args.repeats)
        print(f"{name:<18}" + "".join(f"{1000 * got[n]:8.1f} ({got[n] / got[1]:.2f})" for n in WIDTHS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
