"""Keep freed memory in the process instead of handing it back to the system (glibc's malloc, Linux).

A batch's prefill allocates and frees large temporaries in every layer (a 16-row float32 prefill of prompts up to
1500 tokens: hundreds of MB a layer). glibc serves blocks that large with mmap and unmaps them when they are freed,
so the next layer's temporaries are fresh pages the kernel must fault in and zero again. Measured on the bundled
SmolLM2-135M on this 2-core CPU, 16 rows of Spec-Bench prompts of 364-1487 tokens, float32:

    prefill alone                        42-51 s    with these settings 33 s
    prefill while another 16-row cache
    is alive (a second batch, lockstep)  52-64 s    with these settings 34-36 s

Batch-1 decoding, whose temporaries are small, did not move (34-35 s for 8 answers either way). The bench's lockstep
timing depended on it: the method that prefilled second (after plain, always first) paid 20-25% more for the same
prefill at 16 rows, which alone put every method below plain there.

The cost: the process keeps its peak heap (memory freed is reused by the process, not returned to the system).
`spekit`'s commands call `keep_freed_memory()` at start; `SPEKIT_KEEP_FREED_MEMORY=0` turns it off. The Python
API leaves the host process alone unless it calls the function itself.

Python's cyclic garbage collector, the same way: once the models are loaded, the process holds about 370,000
objects the collector tracks (torch's and transformers' modules, the model's layers, a datastore's index), and
every full collection walks all of them: 190-204 ms, measured here. Such a collection comes when enough new objects
have outlived two younger ones; `rest` at 8 rows (its per-row n-gram index) triggered one every 8-30 s of decoding:
0.7-2.7% of the time, and a 0.2 s stall in the middle of some request's answer or some bench contestant's steps
(a lockstep comparison then charges it to whichever method ran). So the `spekit` command, run from the command
line, asks for `settle()` after each load: a collection, then `gc.freeze()`, which leaves every object alive then
out of later collections (the same rest run: no full collection in 30 s). The cost: cyclic garbage among those
objects is never freed, which in a process that loads its models once and serves or measures with them is none.
`SPEKIT_GC_FREEZE=0` turns it off; the Python API and in-process callers of `cli.main(argv)` leave it alone.
"""
from __future__ import annotations

import ctypes
import gc
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # glibc's mallopt parameters (malloc.h)
LARGEST = 2**31 - 1                              # mallopt takes an int: blocks up to 2 GiB come from the heap


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to serve blocks up to 2 GiB from the heap and never trim it. Returns whether it took
    effect (False off Linux, on another C library, or with SPEKIT_KEEP_FREED_MEMORY=0)."""
    if os.environ.get("SPEKIT_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, LARGEST)) and bool(mallopt(M_TRIM_THRESHOLD, LARGEST))


_settle = False


def freeze_after_loading() -> None:
    """From now on, `settle()` freezes what is loaded (the `spekit` command run from the command line)."""
    global _settle
    _settle = os.environ.get("SPEKIT_GC_FREEZE", "1") != "0"


def settle() -> bool:
    """After a load (spekit.api.Spekit): when asked by `freeze_after_loading`, collect once, then leave every object
    alive now out of the cyclic collector's later full collections (gc.freeze). Returns whether it did."""
    if not _settle:
        return False
    gc.collect()
    gc.freeze()
    return True
