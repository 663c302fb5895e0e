"""Steady glibc malloc settings for a process that generates (`esft train`, `esft eval`, each Ray
actor and each vLLM worker process set them at start).

By default glibc raises its mmap threshold as large blocks are freed and hands freed memory back to the
system, so generate calls that allocate the same tensors again and again pay a varying number of page
faults: measured on this project's 2-core CPU, 13% of a call's CPU time in the kernel and ±18% between
identical calls. Fixing the thresholds (blocks up to 32 MiB from the heap, freed memory kept, 256 MiB top
pad) made `esft train` on the demo 1.14× and 1.12× faster per iteration (2026-11-25, machine B).
glibc's threshold cannot go above 32 MiB, though, and the batched paths' larger blocks (stacked weights,
key/value caches of ~1,000 rows) were still fresh mappings on every call: 111,000 page faults per
iteration with full-rank noise and 43,000 with the demo's low-rank noise, 6% and 3% of its CPU time in
the kernel (vs_reference.py's model and prompts, machine E, 2026-11-26), a cost that changes with how the
VM's host backs fresh memory. So no block is mmap'd at all (M_MMAP_MAX 0): after the first iteration or
two the heap has room for every block and an iteration takes no page faults (a whole 6-iteration
`esft train --noise iid`: 280,000–320,000 faults, 1.4–1.7 s in the kernel, against 510,000–550,000 and
2.0–2.5 s with the 32 MiB threshold). Per iteration that was not measurably faster on E, where the host's
noise is larger (one thread, the preset: 1.01×, 0.95–1.08× over 5 rounds; two threads 0.85–1.29×), but
the cost no longer depends on the host (docs/benchmarks.md). vLLM's
worker process (the demo model, 32 prompts per generate call, 2026-11-27, machine E): with glibc's
defaults a process's median was 4 to 1,800 page faults per call (single calls up to 2,100), with these
3-5 (single calls up to 844); speed not measurably different in three runs (glibc / heap only 1.07x,
noisy, 0.95x with 0.85-1.04x over 5 rounds; docs/benchmarks.md).
The cost is memory: the process keeps its peak heap until it exits, grows it in 256 MiB steps, and
torch's aligned blocks can leave holes the next one does not fit for a while (peak RSS of a 6-iteration
demo 1.1–1.25 GiB, 0–0.1 GiB more than with the 32 MiB threshold).

A user who sets any of the MALLOC_*_ variables keeps their own choice; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MIB = 1 << 20
# mallopt's option number for each setting, named by the environment variable that sets it (glibc malloc.h)
MALLOPT_OPTIONS = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3,
                   "MALLOC_MMAP_MAX_": -4}
# a user who sets any of these keeps their own malloc
USER_SETTINGS = (*MALLOPT_OPTIONS, "MALLOC_ARENA_MAX")
# No block is mmap'd: glibc's threshold stops at 32 MiB, and the batched paths' larger blocks (stacked
# weights, key/value caches of ~1,000 rows) were fresh mappings, so fresh page faults, on every call.
# The same values in the environment (MALLOC_MMAP_MAX_=0 ...) give a process the same malloc.
SETTINGS = {"MALLOC_MMAP_MAX_": 0, "MALLOC_TRIM_THRESHOLD_": 2**31 - 1, "MALLOC_TOP_PAD_": 256 * MIB}


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
    if not all(mallopt(MALLOPT_OPTIONS[name], value) == 1 for name, value in SETTINGS.items()):
        return "allocator: the system's defaults (mallopt refused)"
    return "allocator: glibc, heap only (no mmap, no trimming; esft.allocator)"
