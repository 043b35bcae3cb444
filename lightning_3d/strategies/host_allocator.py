"""On CPU ranks, freed memory stays in the process for the next step, as CUDA's caching allocator keeps freed
device memory.

glibc's malloc serves a large allocation (above its mmap threshold: 128 KiB, rising to at most 32 MiB as such
blocks are freed) with fresh pages from the kernel and unmaps them on free, and it returns the heap's free top
to the kernel once that exceeds its trim threshold. A training step frees and allocates the same large tensors
every step (logits and their gradient, activations), so on CPU each step can fault all of them in again, page by
page, which for a large vocabulary's logits is a sizeable share of the step. ``layout="auto"``'s calibration
times the same calls in loops that reuse their memory, so it would also predict such steps short.

A user's own ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` is left alone, as is any allocator other
than glibc's (on another C library, or jemalloc/tcmalloc preloaded, the call changes nothing that is used).
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameters (``malloc.h``)."""
KEPT_BYTES = 2**30
"""Allocations up to this size come from the heap, and this much of the heap's free top stays in the process.
Larger ones (rare on a CPU rank: a whole checkpoint tensor) are still unmapped on free."""
OLDER_GLIBC_MMAP_LIMIT = 32 * 2**20
"""The mmap threshold asked for where glibc refuses :data:`KEPT_BYTES`: glibc has refused thresholds above half
its largest heap, 32 MiB on 64-bit systems (Debian 12's 2.36 takes 1 GiB)."""
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_host_memory() -> bool:
    """Make glibc keep freed memory up to :data:`KEPT_BYTES` in this process (process-wide, for the rest of its
    life). Returns whether it did: False where the user set either threshold or the C library is not glibc."""
    if any(name in os.environ for name in USER_SETTINGS) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    if not any(mallopt(M_MMAP_THRESHOLD, limit) for limit in (KEPT_BYTES, OLDER_GLIBC_MMAP_LIMIT)):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, KEPT_BYTES))
