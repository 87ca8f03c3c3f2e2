"""Prior costs: what a target forward over n new tokens per row costs relative to a forward over one, before
anything is measured (and always under sampling), per backend and precision.

The engine times every verification step and keeps a running median per batch size and tree-size bucket,
after timing each bucket once in the real context (calibration). Before a bucket has been seen, and always under
sampling (where a draft decision changes which random numbers are used, so it must not depend on the clock or on
the rest of the batch), a prior is used, one table per kind of target (`python scripts/verify_cost.py` measures
the curve on the machine at hand; docs/RESULTS.md has the recorded ones): a float32 target through the fast
forward forms, where two tokens cost about what one does and eight about twice; int4 / int8 layers, about the same;
a bfloat16 target on a CPU with native bf16 arithmetic (AVX-512 bf16 or AMX), nearly flat up to 8 tokens, its own
prior, though 2 tokens are not priced free (at 1.0x sampled rows would draft a token on any acceptance above a few
percent, and a Jacobi block that is almost never accepted would be tried on many steps); and where bfloat16 is
emulated (AVX2 only), products cost in proportion to their rows, so a steep one (`EMULATED_PRIOR`).

A wide forward also costs more, relative to a one-token one, the longer the context: the new tokens attend to every
cached key (in float64 under the row-invariant forms). So every figure is kept per context bucket too (powers of two from 512 keys), and a bucket not measured yet takes
the nearest measured one's ratio scaled by the prior growth between the two (`GROWTH`): a server that alternates
short and long prompts sizes each one's drafts with the costs of its own length, not with the other's.
"""
from __future__ import annotations

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PRIOR = {1: 1.0, 2: 1.05, 4: 1.35, 8: 1.9, 16: 2.6, 32: 3.5, 64: 5.0, 128: 8.0, 256: 14.0, 512: 26.0,
         1024: 50.0}
FLAT_PRIOR = {1: 1.0, 2: 1.03, 4: 1.1, 8: 1.2, 16: 1.6, 32: 2.3, 64: 3.6, 128: 6.0, 256: 11.0, 512: 21.0,
              1024: 40.0}
# `--cost-profile flat`: a forward over any number of new tokens costs what one over a token does (what the papers'
# tree budgets assume, and about what a GPU does at batch 1): every drafter drafts the widest its options allow
UNIT_PRIOR = dict.fromkeys(BUCKETS, 1.0)
EMULATED_PRIOR = {1: 1.0, 2: 1.15, 4: 2.1, 8: 3.6, 16: 6.0, 32: 11.5, 64: 22.0, 128: 43.0, 256: 85.0, 512: 170.0,
                  1024: 340.0}
CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)   # context buckets: keys in the cache
# how many times the extra cost of a wide forward (its cost over a one-token one's, minus 1) at a context bucket is
# that at up to 512 keys; beyond the measured 4096 it grows with the context, as attention comes to dominate
GROWTH = {id(PRIOR): dict(zip(CONTEXTS, (1.0, 1.0, 1.1, 1.6, 2.5, 4.5, 8.5, 16.5, 32.5))),
          id(FLAT_PRIOR): dict(zip(CONTEXTS, (1.0, 1.5, 2.0, 3.0, 5.0, 9.0, 17.0, 33.0, 65.0))),
          id(EMULATED_PRIOR): dict(zip(CONTEXTS, (1.0, 1.0, 1.1, 1.6, 2.5, 4.5, 8.5, 16.5, 32.5)))}


def bucket(n: int) -> int:
    return next((b for b in BUCKETS if n <= b), BUCKETS[-1])


def context_bucket(keys: int) -> int:
    return next((c for c in CONTEXTS if keys <= c), CONTEXTS[-1])


def growth(table: dict[int, float], context: int) -> float:
    """GROWTH of `table` at a context of `context` keys (1.0 for a table it does not know)."""
    return GROWTH.get(id(table), {}).get(context_bucket(context), 1.0)


def prior_cost(nodes: int, batch: int = 1, table: dict[int, float] = PRIOR, context: int = 0) -> float:
    """Prior cost of a step over `nodes` tokens per row for `batch` rows, relative to one token per row, at a
    context of `context` keys (0: a short one)."""
    return 1.0 + (table[bucket(batch * nodes)] / table[bucket(batch)] - 1.0) * growth(table, context)


def smooth_prior_cost(nodes: int, table: dict[int, float] = PRIOR, context: int = 0) -> float:
    """prior_cost for one row, read between the table's power-of-two points (linearly) instead of rounded up to
    the next: where a part of a tree is already paid for (Budget.beneath), a few more nodes cost their share
    of the step to the next point, not the whole step."""
    hi = bucket(nodes)
    lo = max((b for b in BUCKETS if b < nodes), default=1)
    a, b = prior_cost(lo, table=table, context=context), prior_cost(hi, table=table, context=context)
    return a if hi == lo else a + (b - a) * (nodes - lo) / (hi - lo)


def prior_for(dtype: torch.dtype, packed: bool, device_type: str) -> dict[int, float]:
    """The prior table for a target whose weights are of `dtype` (packed: some of its linear layers are packed
    int4 / int8) on a device of `device_type` ("cpu", "cuda"): for bfloat16 / float16 weights without packed layers
    FLAT_PRIOR, or on a CPU without native arithmetic for that type EMULATED_PRIOR; else PRIOR. The target passes
    these facts (pacing reads no model)."""
    if dtype not in (torch.bfloat16, torch.float16) or packed:
        return PRIOR
    return FLAT_PRIOR if device_type != "cpu" or native_half(dtype) else EMULATED_PRIOR


HALF_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16"), torch.float16: ("avx512_fp16", "amx_fp16", "fphp")}


def native_half(dtype: torch.dtype, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies `dtype` natively (its flags in /proc/cpuinfo: AVX-512 bf16 / fp16, AMX, Arm's
    bf16 / fphp); False where that cannot be read."""
    try:
        with open(cpuinfo) as f:
            flags = {word for line in f if line.startswith(("flags", "Features")) for word in line.split()}
    except OSError:
        return False
    return any(flag in flags for flag in HALF_FLAGS[dtype])
