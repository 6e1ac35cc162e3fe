"""Background demotion: keeps the landing tier below a high watermark, so that an
allocation finds a free slot instead of waiting for a victim to be written to disk.

When an allocation leaves an arena of the landing tier fuller than ``demote_above`` it
signals ``core.pressure``, and an idle tick looks too; this thread then demotes the coldest
pages of each draining arena (``Placement.demote_one``: the same eviction and admission
decisions an allocation would make, the writes outside the core's lock, a batch of pages
per write call, sync and index commit) until it is down to ``demote_to``; an arena between
the two watermarks that has not passed the high one is left alone (watermarks.py). A
round the lower tier fails (an I/O error, a full index) leaves its pages in RAM, and the
rounds after it wait, longer each time (``moves.BACKOFF_S``); the arena stays draining,
so an idle tick resumes it. An allocation that still finds no room reclaims a victim
itself (dropping it, if the lower tier fails it too). With no lower tier there is no
demoter (an eviction is then in-memory work); without this thread (the trace replay)
every eviction happens inline, in the order allocations need them.

The thread runs at a lower OS priority (``HostTierConfig.demote_nice``): what it does is
work ahead of need, so on busy cores a lookup or an allocation should not wait behind it
in the run queue. If it falls behind, allocations evict inline at their own priority.
"""

from __future__ import annotations

import logging
import os
import threading

from kvstore.server.placement.core import Placement

logger = logging.getLogger(__name__)

STOP_WARN_S = 10.0  # a stop waiting for the demoter's round says so this often


class Demoter:
    def __init__(self, core: Placement, idle_s: float = 1.0) -> None:
        self.core = core
        self.idle_s = idle_s
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if len(self.core.tiers) < 2:
            return  # nothing to demote to: evictions are in-memory, done inline
        self._thread = threading.Thread(target=self._run, name="demoter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Returns once the round under way has ended (its pages written and indexed, or left
        in RAM), however long a slow disk makes that: the server closes the tiers next, and
        closing them under a write is worse than a slow stop (its descriptor could be reused)."""
        self._stopped.set()
        self.core.pressure.set()  # wakes it
        if self._thread is None:
            return
        self._thread.join(STOP_WARN_S)
        while self._thread.is_alive():
            logger.warning("the demoter is still writing a round down (a slow disk?); the server stops after it")
            self._thread.join(STOP_WARN_S)

    def _run(self) -> None:
        nice = self.core.config.host.demote_nice
        if nice:
            try:  # Linux: a thread's id is a process id to setpriority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except OSError as exc:
                logger.warning("demoter runs at normal priority: %s", exc)
        while not self._stopped.is_set():
            self.core.pressure.wait(self.idle_s)
            try:  # a round on each wake-up and idle tick; the core's watermarks say whether there is one
                while not self._stopped.is_set() and self.core.demote_one():
                    pass
            except Exception:  # the demoter must outlive one bad round
                logger.exception("demotion round failed")
                self._stopped.wait(self.idle_s)
