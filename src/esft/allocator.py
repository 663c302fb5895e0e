"""Steady glibc malloc thresholds for a training process (`esft train` and `esft eval` set them at start).

By default glibc raises its mmap threshold as large blocks are freed and hands freed memory back to the
system, so generate calls that allocate the same tensors again and again pay a varying number of page
faults: measured on this project's 2-core CPU, 13% of a call's CPU time in the kernel and ±18% between
identical calls. Fixing the thresholds (what the MALLOC_*_ environment variables would do at start)
keeps blocks up to 32 MiB in the heap and freed memory in the process: `esft train` on the demo ran
1.14× and 1.12× faster per iteration in two runs (1.11–1.14×, 1.07–1.20× over 3 alternating rounds,
benchmarks/allocator_speed.py). The cost is
memory: the process keeps its peak heap until it exits (a training run reaches it every iteration anyway) and
grows it in 256 MiB steps (peak RSS of a 6-iteration demo: 965–1,135 MiB against 828–1,018 MiB with glibc's defaults).

A user who sets any of the MALLOC_*_ variables keeps their own choice; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MIB = 1 << 20
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")
# mallopt's option numbers (glibc malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = ((_M_MMAP_THRESHOLD, 32 * MIB), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 256 * MIB))


def steady_allocator() -> str:
    """Set the thresholds for this process when glibc is its C library and the user set none of
    USER_SETTINGS. Returns what was done, in words (benchmarks print it in their headers)."""
    chosen = [name for name in USER_SETTINGS if name in os.environ]
    if chosen:
        return f"allocator: the user's glibc settings ({', '.join(chosen)})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "allocator: the system's defaults (no glibc mallopt here)"
    if not all(mallopt(option, value) == 1 for option, value in SETTINGS):
        return "allocator: the system's defaults (mallopt refused)"
    return "allocator: glibc, fixed thresholds (mmap 32 MiB, no trimming; esft.allocator)"
