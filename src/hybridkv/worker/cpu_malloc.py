"""Keep large CPU tensor buffers in the allocator's heap instead of fresh mappings.

glibc's malloc serves a request above its mmap threshold (128 KiB, rising to at most 32 MiB
as large blocks are freed) with a new mmap, and gives it back with munmap on free. A forward
pass allocates and frees activations of [tokens, hidden] every op, so a long prefill takes
page faults on every fresh page of every op: measured here, an RMSNorm over a 2,048 x 768
float32 tensor took 6.1 ms that way and 0.76 ms from the heap (8x); GEMM outputs and
element-wise ops pay the same. Raising the mmap and trim thresholds keeps freed buffers in
the heap for the next op, as tcmalloc (which vLLM's CPU backend preloads) does. The cost:
the process keeps its peak activation memory instead of returning it between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Buffers below this come from the heap; larger ones (rare: a whole KV arena) stay mmapped.
THRESHOLD = 1 << 30

_done = False


def keep_buffers_in_heap() -> bool:
    """Raise glibc's mmap and trim thresholds, once per process. False where the C library
    has no `mallopt` (not glibc) or refused the values; nothing changes then."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        logger.debug("no mallopt in the C library (%s): allocator left as it is", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, THRESHOLD))
    _done = ok
    return ok


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim), once loading is
    done: building a tokenizer or reading weights frees far more than a forward pass ever
    reuses, and with the trim threshold raised (above) nothing else would return it."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))
