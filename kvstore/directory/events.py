"""STORED / REMOVED / CLEARED events with sequence numbers, kept in a bounded ring.

A subscriber asks for events from a sequence number on. If those are no longer in the ring
(or were lost in a restart) it first gets RESYNC: its picture is stale, rebuild with Lookup.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from dataclasses import dataclass

from kvstore.types import Location


class EventKind(enum.IntEnum):
    STORED = 1
    REMOVED = 2
    CLEARED = 3
    RESYNC = 4


@dataclass(frozen=True)
class Event:
    seq: int
    kind: EventKind
    namespace_id: bytes
    key: bytes
    location: Location | None
    unix_ms: int


class EventLog:
    """Thread-safe; ``wait_since`` blocks a subscriber until there is something new."""

    def __init__(self, first_seq: int = 1, capacity: int = 1 << 16) -> None:
        self._events: deque[Event] = deque(maxlen=capacity)
        self._next = first_seq
        self._cond = threading.Condition()
        self._closed = False

    @property
    def last_seq(self) -> int:
        return self._next - 1

    def append(self, kind: EventKind, namespace_id: bytes, key: bytes = b"", location: Location | None = None) -> int:
        with self._cond:
            seq = self._next
            self._next += 1
            self._events.append(Event(seq, kind, namespace_id, key, location, int(time.time() * 1000)))
            self._cond.notify_all()
            return seq

    def since(self, from_seq: int) -> list[Event]:
        """Events with seq >= from_seq; a leading RESYNC if some of them are gone."""
        with self._cond:
            return self._since_locked(from_seq)

    def _since_locked(self, from_seq: int) -> list[Event]:
        oldest = self._events[0].seq if self._events else self._next
        out: list[Event] = []
        if from_seq < oldest and from_seq <= self.last_seq:
            out.append(Event(oldest - 1, EventKind.RESYNC, b"", b"", None, int(time.time() * 1000)))
        start = max(from_seq, oldest)
        if self._events and start <= self.last_seq:
            out.extend(list(self._events)[start - oldest :])
        return out

    def wait_since(self, from_seq: int, timeout_s: float) -> list[Event]:
        with self._cond:
            if from_seq > self.last_seq and not self._closed:
                self._cond.wait(timeout_s)
            return self._since_locked(from_seq)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed
