"""Keep glibc from handing freed memory back to the kernel between requests.

A server answers with buffers of megabytes (a batch of values). Left to
itself, glibc serves such sizes with fresh mmap()s, or trims the heap once
they are freed, so every request pays page faults and page zeroing for the
same memory again. Which way it goes depends on the process's allocation
history: under gRPC gets after a cache fill the page faults cost half the
server's CPU in `perf` (tools/bench/hitpath). Fixing both thresholds makes
the memory be reused. The cost is that the process keeps its peak heap.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX / 2 on 64-bit)
TRIM_THRESHOLD = 256 << 20

log = logging.getLogger(__name__)


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Set glibc's mmap and trim thresholds; False where there is no glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    if not ok:
        log.warning("mallopt refused the thresholds; memory is returned to the kernel as usual")
    return ok
