"""The event ring's memory is taken at its start (DESIGN §11: a soak's server RSS must not grow
by more than 5% from minute 1 on; a ring of objects filling for minutes looked like a leak)."""

from __future__ import annotations

import tracemalloc

from kvstore.directory import EventKind, EventLog
from kvstore.types import Location


def _fill(log: EventLog, count: int, first: int = 0) -> None:
    for i in range(first, first + count):
        log.append(EventKind.STORED, bytes([i % 7]) * 16, i.to_bytes(16, "little"),
                   Location("node-a", "host", i, 32768))


def test_the_ring_takes_its_memory_at_the_start() -> None:
    """Filling a ring of 4096 events twice over allocates (almost) nothing: its records were
    laid out when it was made. (A deque of Event objects grew by ~380 B per event.)"""
    log = EventLog(capacity=4096)
    _fill(log, 16)  # the name table's first entries
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        _fill(log, 2 * 4096, first=16)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 4096 * 8, f"the ring grew by {after - before} bytes while filling"


def test_events_read_back_as_they_were_logged() -> None:
    log = EventLog(first_seq=5, capacity=8)
    log.append(EventKind.STORED, b"n" * 16, b"k" * 16, Location("node-a", "ssd", 3, 4096))
    log.append(EventKind.REMOVED, b"n" * 16, b"k" * 16, Location("node-b", "host", 2**40, 1 << 20))
    log.append(EventKind.CLEARED, b"m" * 16)
    log.append(EventKind.STORED, b"short", b"a-key-longer-than-sixteen-bytes", None)  # any size is kept whole
    stored, removed, cleared, odd = log.since(5)
    assert (stored.seq, stored.kind, stored.namespace_id, stored.key, stored.location) == (
        5, EventKind.STORED, b"n" * 16, b"k" * 16, Location("node-a", "ssd", 3, 4096))
    assert (removed.kind, removed.location) == (EventKind.REMOVED, Location("node-b", "host", 2**40, 1 << 20))
    assert (cleared.seq, cleared.kind, cleared.namespace_id, cleared.key, cleared.location) == (7, EventKind.CLEARED, b"m" * 16, b"", None)
    assert (odd.namespace_id, odd.key, odd.location) == (b"short", b"a-key-longer-than-sixteen-bytes", None)
    assert stored.unix_ms > 0 and log.last_seq == 8


def test_an_odd_sized_key_leaves_with_its_record() -> None:
    """Ids of another size are kept beside the ring, and go when their record is overwritten."""
    log = EventLog(capacity=2)
    log.append(EventKind.STORED, b"n" * 16, b"x" * 40)
    _fill(log, 4)
    assert [len(e.key) for e in log.since(1)[1:]] == [16, 16]
    assert len(log._odd) == 0  # the side table is bounded by the ring
