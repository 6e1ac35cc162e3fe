"""Process memory settings for moving large buffers, and for a server that runs for months.

More: kvstore/README.md (### memory.py); DESIGN §12.9.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (HEAP_MAX/2)
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20
ARENA_MAX = 2  # glibc's default is 8 per core: each thread's peak is kept in its own untrimmed heap


def _libc_function(name: str, restype: Any, argtypes: list[Any]) -> Any:
    """The C library's ``name``, typed; None where it has none (not glibc, or too old a one)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def tune_malloc() -> bool:
    """Keeps buffers up to 32 MiB on the heap and the heap untrimmed below 1 GiB, in at most
    ARENA_MAX heaps (untrimmed heaps per thread would each keep the peak of whatever request
    that thread parsed); False (logged at debug) where the C library is not glibc."""
    mallopt = _libc_function("mallopt", ctypes.c_int, [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        logger.debug("mallopt not available (C library %s); malloc left as is", ctypes.util.find_library("c"))
        return False
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD),
        (_M_ARENA_MAX, ARENA_MAX)))
    if not ok:
        logger.debug("mallopt refused a setting; malloc partly tuned")
    return ok


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_MALLINFO2: Callable[[], _MallInfo2] | None = _libc_function("mallinfo2", _MallInfo2, [])  # glibc >= 2.33


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


TCACHE_OFF = "glibc.malloc.tcache_count=0"
HEAP_TRIM_S = 10.0  # jemalloc's default decay of unused dirty pages is 10 s too


def tcache_env(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment that starts this process again with glibc's per-thread cache off;
    None where there is nothing to do: not glibc, or GLIBC_TUNABLES already names a tcache
    count (ours, after the re-exec, or the operator's own)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.tcache_count" in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TCACHE_OFF}" if tunables else TCACHE_OFF}


def without_tcache() -> None:
    """Re-executes this process (same pid, argv and descriptors) with the tcache off, before
    anything is started; returns where it is off already or cannot be (logged)."""
    env = tcache_env(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError as exc:
        logger.warning("could not restart with glibc's tcache off (%s); running with it", exc)


class HeapTrimmer:
    """Gives the C heap's free pages back to the kernel every ``period_s`` (malloc_trim: the
    free space at the top and the whole pages inside free chunks; a few ms when there are
    tens of MB, microseconds when there is nothing to give)."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.trims = 0
        self._trim: Callable[[int], int] | None = _libc_function("malloc_trim", ctypes.c_int, [ctypes.c_size_t])
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heap-trim", daemon=True)

    def start(self) -> bool:
        """False where there is nothing to run: a period of 0, or no malloc_trim (not glibc)."""
        if self.period_s <= 0 or self._trim is None:
            return False
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        assert self._trim is not None
        while not self._stopped.wait(self.period_s):
            self._trim(0)
            self.trims += 1
