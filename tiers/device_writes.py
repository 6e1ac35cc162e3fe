"""Bytes a tier's index transactions send to the device, measured where the kernel counts them.

LMDB writes whole 4 KiB pages, copy-on-write: one transaction that adds a 140-byte index
entry writes its leaf page, the branch pages above it, free-list pages and a meta page. In a
tree of 20,000 entries 64 new entries cost about 175 pages (0.7 MB), so the cost cannot be
derived from entry sizes. It is measured: ``write_bytes`` of /proc/thread-self/io (bytes this
thread caused to be sent to storage; LMDB commits in the calling thread) around each write
transaction. Where that file is missing (not Linux, no task I/O accounting) an estimate stands
in: three pages per entry and two per transaction.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

PAGE_BYTES = 4096
_IO_FILE = "/proc/thread-self/io"


def thread_write_bytes() -> int | None:
    """Bytes the calling thread has caused to be written to storage, or None when unknown."""
    try:
        with open(_IO_FILE, "rb") as f:
            for line in f:
                if line.startswith(b"write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class IndexWrites:
    """Device bytes of index transactions since ``take`` was last called. Thread-safe: a
    transaction is measured in the thread that commits it, and ``take`` may come from any."""

    def __init__(self) -> None:
        self._pending = 0
        self._lock = threading.Lock()
        self.measured = thread_write_bytes() is not None
        if not self.measured:
            logger.info("ssd tier: %s unreadable; index writes are estimated, not measured", _IO_FILE)

    @contextmanager
    def transaction(self, num_entries: int) -> Iterator[None]:
        """Wraps one write transaction touching ``num_entries`` entries."""
        before = thread_write_bytes() if self.measured else None
        try:
            yield
        finally:
            after = thread_write_bytes() if before is not None else None
            spent = after - before if before is not None and after is not None else PAGE_BYTES * (3 * num_entries + 2)
            with self._lock:
                self._pending += spent

    def take(self) -> int:
        """The bytes written since the last call."""
        with self._lock:
            pending, self._pending = self._pending, 0
        return pending
