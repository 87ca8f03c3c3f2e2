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
"""
from __future__ import annotations

import ctypes
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
