"""Streaming RPCs get a bounded share of the server's threads, and lose it when idle.

grpcio's sync server holds a thread for every open RPC, a stream included, for as long as it
is open. So streams are admitted up to ``max_streams`` at once (``LimitExceeded``, i.e.
RESOURCE_EXHAUSTED, beyond) and the server's pool has ``workers`` threads more than that:
however many streams are open, unary calls (a Lookup, Stats) find a thread.

More: kvstore/server/services/README.md (### streams.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from kvstore.errors import LimitExceeded

logger = logging.getLogger(__name__)


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class StreamSlot:
    """One admitted stream: when it last moved a message, whether the server is busy with
    what it received (then it is not idle, however long that takes: a durable commit), and
    whether the watchdog cancelled it."""

    __slots__ = ("busy", "cancelled", "context", "last_s", "method")

    def __init__(self, method: str, context: Cancellable) -> None:
        self.method = method
        self.context = context
        self.last_s = time.monotonic()
        self.busy = False
        self.cancelled = False

    def touch(self, busy: bool = False) -> None:
        self.last_s = time.monotonic()
        self.busy = busy


class StreamGate:
    """Admits streams up to ``max_streams``; cancels those idle for ``idle_s``. Thread-safe."""

    def __init__(self, max_streams: int, idle_s: float) -> None:
        self.max_streams = max_streams
        self.idle_s = idle_s
        self._open: set[StreamSlot] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def num_open(self) -> int:
        return len(self._open)

    def open(self, method: str, context: Cancellable) -> StreamSlot:
        with self._lock:
            if len(self._open) >= self.max_streams:
                raise LimitExceeded(f"{method}: {len(self._open)} streams are open, at most {self.max_streams} (--max-streams); "
                                    "retry later")
            slot = StreamSlot(method, context)
            self._open.add(slot)
            return slot

    def close(self, slot: StreamSlot) -> None:
        with self._lock:
            self._open.discard(slot)

    def start(self) -> None:
        self._watchdog = threading.Thread(target=self._watch, name="stream-watchdog", daemon=True)
        self._watchdog.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._watchdog is not None:
            self._watchdog.join(5)

    def _watch(self) -> None:
        interval = min(1.0, self.idle_s / 4)
        while not self._stopped.wait(interval):
            try:
                self.cancel_idle()
            except Exception:  # the watchdog must outlive one bad round
                logger.exception("stream watchdog round failed")

    def cancel_idle(self) -> int:
        """Cancels the streams idle for longer than ``idle_s``; returns how many."""
        now = time.monotonic()
        with self._lock:
            idle = [slot for slot in self._open if not (slot.cancelled or slot.busy) and now - slot.last_s > self.idle_s]
            for slot in idle:
                slot.cancelled = True
        for slot in idle:
            logger.info("%s stream moved nothing for %.0f s; cancelling it", slot.method, now - slot.last_s)
            slot.context.cancel()
        return len(idle)
