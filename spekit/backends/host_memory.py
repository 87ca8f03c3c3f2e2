"""Keep freed memory in the process instead of handing it back to the system (glibc's malloc, Linux).

A batch's prefill allocates and frees large temporaries in every layer (a 16-row float32 prefill of prompts up to
1500 tokens: hundreds of MB a layer). glibc serves blocks that large with mmap and unmaps them when they are freed,
so the next layer's temporaries are fresh pages the kernel must fault in and zero again: a large batch's prefill
then spends much of its time in page faults, more so while another batch's cache is alive (the bench's lockstep
would charge that to whichever method prefilled second). Batch-1 decoding, whose temporaries are small, does not
depend on it.

The cost: the process keeps its peak heap (memory freed is reused by the process, not returned to the system).
`spekit`'s commands call `keep_freed_memory()` at start; `SPEKIT_KEEP_FREED_MEMORY=0` turns it off. The Python
API leaves the host process alone unless it calls the function itself.

Python's cyclic garbage collector, the same way: once the models are loaded, the process holds about 370,000
objects the collector tracks (torch's and transformers' modules, the model's layers, a datastore's index), and
every full collection walks all of them, a stall of a sizeable fraction of a second. Such a collection comes when
enough new objects have outlived two younger ones (a drafter's per-row index makes them), in the middle of some
request's answer or some bench contestant's steps (a lockstep comparison then charges it to whichever method ran).
So the `spekit` command, run from the command line, asks for `settle()` after each load: a collection, then
`gc.freeze()`, which leaves every object alive then out of later collections. The cost: cyclic garbage among those
objects is never freed, which in a process that loads its models once and serves or measures with them is none.
`SPEKIT_GC_FREEZE=0` turns it off; the Python API and in-process callers of `spekit.commands.main(argv)` leave it alone.
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
