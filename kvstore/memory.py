"""Process memory settings for moving large buffers.

Page-sized transient buffers (a 1 MiB gRPC message, a 2.25 MiB page) sit above glibc's
default mmap threshold, so each one is mapped fresh and unmapped on free; on VMs whose
balloon driver hands freed memory back to the host, touching fresh memory runs at a
fraction of memcpy speed (measured here: 0.3-1.9 GB/s against 7 GB/s for reused memory).
Keeping such buffers on the heap and not trimming it makes them reused memory. The
server, the benchmarks and the raw gRPC pump they compare against call ``tune_malloc``
at start; an engine embedding the client may call it too (it affects the whole process).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (HEAP_MAX/2)
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20
ARENA_MAX = 2  # glibc's default is 8 per core: each thread's peak is kept in its own untrimmed heap


def tune_malloc() -> bool:
    """Keeps buffers up to 32 MiB on the heap and the heap untrimmed below 1 GiB, in at most
    ARENA_MAX heaps (untrimmed heaps per thread would each keep the peak of whatever request
    that thread parsed); False (logged at debug) where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        logger.debug("mallopt not available (C library %s); malloc left as is", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD),
        (_M_ARENA_MAX, ARENA_MAX)))
    if not ok:
        logger.debug("mallopt refused a setting; malloc partly tuned")
    return ok


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c")).mallinfo2
    except (OSError, AttributeError, TypeError):  # not glibc, or one older than 2.33
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_MALLINFO2 = _mallinfo2()


def heap_bytes() -> dict[str, int] | None:
    """The C heap of this process, from glibc's mallinfo2: ``in_use`` (allocated, heap and
    mmapped chunks) and ``free`` (malloc's free space: freed buffers kept for reuse, which
    tune_malloc keeps on purpose, and untouched space such as the top pad, so it can exceed
    RssAnon). A leak of C allocations shows in ``in_use``. None where the C library does not
    say (not glibc >= 2.33)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return {"in_use": info.uordblks + info.hblkhd, "free": info.fordblks}
