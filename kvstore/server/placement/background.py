"""Running a thread behind the foreground: the demoter and the verifier of its batches do
work ahead of need, so on busy cores a lookup, an allocation or a durable put should not
wait behind them for a CPU.

More: kvstore/server/placement/README.md (### background.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Iterator
from typing import TypeVar

from kvstore.page import PageHeader

logger = logging.getLogger(__name__)

_PR_SET_NAME = 15
BEHIND_WRITE_BYTES = 2 << 20  # a background write goes down in pieces of about this much (dd bs=2M beside)
Placed = TypeVar("Placed", bound=tuple[int, PageHeader, memoryview])

def name_thread(name: str) -> None:
    """Names the calling thread for the OS (``top -H``, ``ps -L``, ``/proc/PID/task/TID/comm``;
    15 bytes at most): Python's thread names stay inside Python, and an operator, or
    kvstore-bench lookup's meter of the demoter's CPU, tells the background threads apart by it."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # no prctl (not Linux): the OS keeps the process's name
        pass


def run_behind(sched: str, nice: int) -> None:
    """Lowers the calling thread (only it: Linux schedules threads): SCHED_IDLE for ``idle``,
    else niceness ``nice``; where the OS refuses the idle class (a seccomp profile), niceness
    ``nice`` too. Where it refuses that as well, says so and leaves the thread as it was."""
    if sched == "idle":
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
            return
        except (OSError, AttributeError) as exc:  # AttributeError: an OS without SCHED_IDLE
            logger.warning("%s runs at niceness %d, not in the idle class: %s", threading.current_thread().name, nice, exc)
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)  # a thread's id is a process id to it
        except OSError as exc:
            logger.warning("%s runs at normal priority: %s", threading.current_thread().name, exc)


def lift(native_id: int | None) -> None:
    """Puts the thread ``native_id`` back in the normal class at niceness 0, where the OS lets
    this process (an unprivileged one may not: the thread then stays where it is). Only a
    thread of this process: an id outlives its thread and Linux hands it out again, to any
    process, and a root server would move that thread."""
    if native_id is None or not os.path.exists(f"/proc/self/task/{native_id}"):
        return  # not started, or ended
    try:
        os.sched_setscheduler(native_id, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, native_id, 0)
    except (OSError, AttributeError) as exc:  # EPERM unprivileged; ESRCH it ended
        logger.debug("thread %d stays behind: %s", native_id, exc)


def is_behind() -> bool:
    """Whether the calling thread runs in the idle class (its work goes to the idle verifier)."""
    try:
        return os.sched_getscheduler(0) == os.SCHED_IDLE
    except (OSError, AttributeError):
        return False


def write_pieces(placed: list[Placed], behind: bool) -> Iterator[list[Placed]]:
    """The pages of a write as the tier is handed them: the foreground's at once (one
    pwritev), the background's in pieces of whole pages of about BEHIND_WRITE_BYTES (a page
    larger alone). The kernel pins an O_DIRECT write's pages and builds its requests without a
    preemption point: on a kernel built without preemption (PREEMPT_NONE, as our 2-core dev VM's) a demotion
    round's 32 MiB pwritev held its CPU ~1 ms, and a lookup woken meanwhile waited for it (DESIGN §6)."""
    if not behind:
        yield placed
        return
    piece: list[Placed] = []
    piece_bytes = 0
    for page in placed:
        size = page[1].payload_bytes
        if piece and piece_bytes + size > BEHIND_WRITE_BYTES:
            yield piece
            piece, piece_bytes = [], 0
        piece.append(page)
        piece_bytes += size
    if piece:
        yield piece
