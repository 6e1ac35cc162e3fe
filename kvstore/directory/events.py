"""STORED / REMOVED / CLEARED events with sequence numbers, kept in a bounded ring.

A subscriber asks for events from a sequence number on. If those are no longer in the ring
(or were lost in a restart) it first gets RESYNC: its picture is stale, rebuild with Lookup.

More: kvstore/directory/README.md (### events.py).
"""

from __future__ import annotations

import enum
import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.types import NAMESPACE_ID_BYTES, PAGE_KEY_BYTES, Location

logger = logging.getLogger(__name__)

# seq, unix_ms, kind, flags, namespace id (its length, its bytes), key (likewise),
# location: node and tier (name table indexes), version, size; the namespace's generation
_RECORD = struct.Struct(f"<qqBBB{NAMESPACE_ID_BYTES}sB{PAGE_KEY_BYTES}sHHqqQ")
_HAS_LOCATION, _KEPT_BESIDE = 1, 2  # flags
_MAX_NAMES = 1 << 16
_INT64 = range(-(1 << 63), 1 << 63)
StoredListener = Callable[[bytes, frozenset[str]], None]  # (namespace id, the nodes of the locations published)


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
    generation: int = 0  # the namespace's generation when it happened (CLEARED: the new one)


class EventLog:
    """Thread-safe; ``wait_since`` blocks a subscriber until there is something new."""

    def __init__(self, first_seq: int = 1, capacity: int = 1 << 16) -> None:
        self._capacity = capacity
        self._buf = bytearray(b"\xff") * (capacity * _RECORD.size)  # written through: resident now
        self._first = first_seq  # the first seq this log was given (none before it is in the ring)
        self._next = first_seq
        self._names: list[str] = []
        self._name_ids: dict[str, int] = {}
        self._odd: dict[int, tuple[bytes, bytes, Location | None]] = {}  # slot -> what did not fit its record
        self._cond = threading.Condition()
        self._closed = False
        self._listeners: list[StoredListener] = []

    @property
    def last_seq(self) -> int:
        return self._next - 1

    def append(self, kind: EventKind, namespace_id: bytes, key: bytes = b"", location: Location | None = None,
               generation: int = 0, wake: bool = True) -> int:
        """Adds an event; ``wake=False`` leaves the waiters asleep until ``stored`` (a publish's
        pages: one wake for all of them, not one per page traded for the GIL with the publisher)."""
        with self._cond:
            seq = self._next
            self._next += 1
            slot = seq % self._capacity
            self._odd.pop(slot, None)
            self._write(slot, seq, kind, namespace_id, key, location, generation)
            if wake:
                self._cond.notify_all()
            return seq

    def listen(self, listener: StoredListener) -> None:
        """``listener`` is called on the publishing thread once a publish's STORED events are in
        the log and its entries readable: a subscriber that acts on them at once (a handoff's
        push, DESIGN §12.7) skips the wake of a thread in ``wait_since``. It must not block: it
        hands the work on (``call_soon_threadsafe``)."""
        self._listeners.append(listener)

    def unlisten(self, listener: StoredListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def stored(self, namespace_id: bytes, nodes: frozenset[str]) -> None:
        """A publish's STORED events are all in (``Directory._publish``): the waiters woken, the
        listeners told."""
        with self._cond:
            self._cond.notify_all()
        for listener in list(self._listeners):
            try:
                listener(namespace_id, nodes)
            except Exception:  # the publish is done: a listener's failure is its own, not the commit's
                logger.exception("a listener of published pages failed")

    def _name(self, name: str) -> int | None:
        found = self._name_ids.get(name)
        if found is None and len(self._names) < _MAX_NAMES:
            found = self._name_ids[name] = len(self._names)
            self._names.append(name)
        return found

    def _write(self, slot: int, seq: int, kind: EventKind, namespace_id: bytes, key: bytes,
               location: Location | None, generation: int) -> None:
        node = tier = 0
        flags = 0
        if location is not None:
            flags = _HAS_LOCATION
            found_node, found_tier = self._name(location.node), self._name(location.tier)
            if found_node is None or found_tier is None or location.version not in _INT64 or location.size_bytes not in _INT64:
                flags = _KEPT_BESIDE
            else:
                node, tier = found_node, found_tier
        if len(namespace_id) > NAMESPACE_ID_BYTES or len(key) > PAGE_KEY_BYTES:
            flags = _KEPT_BESIDE
        if flags == _KEPT_BESIDE:
            self._odd[slot] = (namespace_id, key, location)
            namespace_id = key = b""
            location = None
        _RECORD.pack_into(self._buf, slot * _RECORD.size, seq, int(time.time() * 1000), kind, flags, len(namespace_id),
                          namespace_id, len(key), key, node, tier,
                          location.version if location else 0, location.size_bytes if location else 0, generation)

    def _read(self, seq: int) -> Event:
        slot = seq % self._capacity
        (_, unix_ms, kind, flags, ns_len, namespace_id, key_len, key, node, tier, version,
         size_bytes, generation) = _RECORD.unpack_from(self._buf, slot * _RECORD.size)
        if flags == _KEPT_BESIDE:
            ns, k, location = self._odd[slot]
            return Event(seq, EventKind(kind), ns, k, location, unix_ms, generation)
        location = Location(self._names[node], self._names[tier], version, size_bytes) if flags == _HAS_LOCATION else None
        return Event(seq, EventKind(kind), namespace_id[:ns_len], key[:key_len], location, unix_ms, generation)

    def since(self, from_seq: int) -> list[Event]:
        """Events with seq >= from_seq; a leading RESYNC if some of them are gone."""
        with self._cond:
            return self._since_locked(from_seq)

    def _since_locked(self, from_seq: int) -> list[Event]:
        oldest = max(self._first, self._next - self._capacity)
        out: list[Event] = []
        if from_seq < oldest and from_seq <= self.last_seq:
            out.append(Event(oldest - 1, EventKind.RESYNC, b"", b"", None, int(time.time() * 1000)))
        out.extend(self._read(seq) for seq in range(max(from_seq, oldest), self._next))
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
