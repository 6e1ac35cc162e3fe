"""Background demotion: keeps the landing tier below a high watermark, so that an
allocation finds a free slot instead of waiting for a victim to be written to disk.

More: kvstore/server/placement/README.md (### demoter.py).
"""

from __future__ import annotations

import logging
import threading

from kvstore.server.placement.background import lift, name_thread, run_behind
from kvstore.server.placement.core import Placement

logger = logging.getLogger(__name__)

STOP_WARN_S = 10.0  # a stop waiting for the demoter's round says so this often


class Demoter:
    def __init__(self, core: Placement, idle_s: float = 1.0) -> None:
        self.core = core
        self.idle_s = idle_s
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        if len(self.core.tiers) < 2:
            return  # nothing to demote to: evictions are in-memory, done inline
        host = self.core.config.host
        self._threads = [threading.Thread(target=self._run, args=(host.demote_sched,), name="demoter", daemon=True)]
        if host.demote_sched == "idle":
            self._threads.append(threading.Thread(target=self._run_urgent, name="demoter-urgent", daemon=True))
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Returns once the rounds under way have ended (their pages written and indexed, or
        left in RAM), however long a slow disk makes that: the server closes the tiers next, and
        closing them under a write is worse than a slow stop (its descriptor could be reused). The
        CLI's --stop-timeout-s ends a stop that takes longer as a crash would: nothing is closed under
        the write, and the round was never acknowledged to anyone."""
        self._stopped.set()
        self.core.pressure.set()  # wakes them
        self.core.starved.set()
        for thread in self._threads:
            lift(thread.native_id)  # a round under way ends at disk speed, not on the CPU a busy host leaves over
        for thread in self._threads:
            thread.join(STOP_WARN_S)
            while thread.is_alive():
                logger.warning("the %s is still writing a round down (a slow disk?); the server stops after it", thread.name)
                thread.join(STOP_WARN_S)

    def _run(self, sched: str) -> None:
        name_thread("kv-demoter")
        run_behind(sched, self.core.config.host.demote_nice)
        while not self._stopped.is_set():
            self.core.pressure.wait(self.idle_s)
            self._drain()  # a round on each wake-up and idle tick; the core's watermarks say whether there is one

    def _run_urgent(self) -> None:
        name_thread("kv-demoter-urg")
        run_behind("normal", self.core.config.host.demote_nice)
        while not self._stopped.is_set():
            if self.core.starved.wait(self.idle_s):
                self.core.starved.clear()
                self._drain()

    def _drain(self) -> None:
        try:
            while not self._stopped.is_set() and self.core.demote_one():
                pass
        except Exception:  # the demoter must outlive one bad round
            logger.exception("demotion round failed")
            self._stopped.wait(self.idle_s)
