"""Where one decoding step's time goes: plain greedy steps of the target under torch.profiler, grouped.

    python scripts/profile_step.py [--model smollm2-135m] [--quantize none|int8|int4] [--cache slot|dynamic]
                                   [--compile] [--context 300] [--steps 20]

Prints the wall time of a step (median) and the profiler's operator time by group, per step; what is left of
the wall time is Python and dispatch overhead. `--cache dynamic` is transformers' DynamicCache (grown by torch.cat
at every step), the cache spekit used before its slot cache.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from spekit.cache import KVState
from spekit.backends.torch_models import load_model
from spekit.backends.torch_target import Target

GROUPS = [("linear layers", ("mm", "addmm", "linear", "_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "bmm")),
          ("attention", ("scaled_dot_product", "_scaled_dot_product")),
          ("cache copies", ("cat", "index_copy", "copy_", "slice_scatter", "gather")),
          ("norms, rotary, activations", ("mul", "add", "pow", "mean", "rsqrt", "silu", "neg", "div", "sum", "where",
                                          "sub", "cos", "sin", "exp", "to", "_to_copy", "embedding", "index_select"))]


def group_of(name: str) -> str:
    op = name.removeprefix("aten::")
    for group, names in GROUPS:
        if any(op == n or op.startswith(n + "_") or (n.startswith("_") and op.startswith(n)) for n in names):
            return group
    return "other operators"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantize", default="none", choices=["none", "int8", "int4"])
    p.add_argument("--cache", default="slot", choices=["slot", "dynamic"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    target = Target(load_model(args.model, args.dtype, quantize=args.quantize).model, compile=args.compile)
    kv = (target.new_state(1) if args.cache == "slot"
          else KVState(1, target.device, target.dtype, target.sliding_window))
    kv.reserve(args.context + 4 * args.steps + 64)
    logits, _ = target.prefill(kv, [list(range(1, args.context + 1))])
    token = logits.argmax(-1)[:, None]                                   # [1, 1]
    one = torch.ones(1, 1, 1, dtype=torch.bool)

    def step():
        nonlocal token
        out, _ = target.forward(kv, token, kv.next_positions()[:, None], one)
        token = out[:, -1].argmax(-1)[:, None]

    for _ in range(3):
        step()
    walls = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
    wall = statistics.median(walls) * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    groups: dict[str, float] = {}
    for event in prof.key_averages():
        if event.key.startswith("aten::") or event.key.startswith("torch_"):
            groups[group_of(event.key)] = groups.get(group_of(event.key), 0.0) + event.self_cpu_time_total
    ops = {g: t / 1e3 / args.steps for g, t in groups.items()}
    label = f"{args.dtype}, quantize {args.quantize}, {args.cache} cache{', compiled' if args.compile else ''}"
    print(f"one decoding step ({args.model}, {label}, context {args.context}): {wall:.1f} ms wall (median)")
    for g, ms in sorted(ops.items(), key=lambda kv: -kv[1]):
        print(f"  {g:30s} {ms:6.1f} ms")
    print(f"  {'Python and dispatch (rest)':30s} {max(wall - sum(ops.values()), 0.0):6.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
