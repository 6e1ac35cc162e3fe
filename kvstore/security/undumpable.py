"""Keeps other processes of the server's uid out of the server's memory and descriptors.

With tenants the server holds every tenant's arena (tiers/arenas.py) as a file descriptor
with no name in any filesystem; a process of the same uid could still open one through
``/proc/<server pid>/fd/N``, or read the server's memory (ptrace, ``/proc/<pid>/mem``). A
process that is not *dumpable* (``prctl(PR_SET_DUMPABLE, 0)``) has its ``/proc/<pid>/``
entries owned by root and refuses ptrace access to anyone without CAP_SYS_PTRACE, so those
routes are closed to the same uid. Cost: the server leaves no core dump. Only ``main()``
calls this (a process-wide setting; tests run servers inside pytest).
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

PR_SET_DUMPABLE = 4


def forbid_inspection() -> bool:
    """Makes this process undumpable; False (logged) when the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        logger.warning("cannot make the server undumpable (errno %d): processes of its uid can open its arenas "
                       "through /proc/<pid>/fd", ctypes.get_errno())
        return False
    return True
