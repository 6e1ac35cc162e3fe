"""Putting a page back together from the chunks of a page stream, written once for both
ends: the server's WritePages and the client's ReadPages.

A ``ChunkedPage`` takes one page's chunks in order: it checks that each continues where the
last ended and that the page does not overrun its length, puts the bytes where they go
(a ``PageSink``; none: they are only checked) and hashes them as they pass, so a page is
copied once. A page sent whole in one chunk (up to 4 MiB, the default) is copied and
hashed in one pass. The page counts only once its checksum holds; until then its
destination holds unverified bytes, which ``abandon`` clears.

Who is to blame for a malformed stream differs (a client sending bad chunks is an invalid
request; a server sending them is corrupt data), so the caller names the error class.
"""

from __future__ import annotations

from typing import Protocol

from kvstore.errors import KVStoreError, PageCorrupt
from kvstore.page import checksum, checksummer
from kvstore.pagecopy import copy_checksum_bytes
from kvstore.wire import WireChunk


class PageSink(Protocol):
    """Where the bytes of one page go as they arrive (layer-major offsets)."""

    def write(self, start: int, data: memoryview) -> None: ...

    def write_all(self, data: memoryview) -> int:
        """Writes the whole page and returns the checksum of its bytes, in one pass."""
        ...

    def clear(self) -> None:
        """Forgets unverified bytes (a page that failed must not reach its reader)."""
        ...


class BufferSink:
    """A page into one contiguous buffer (a host-tier slot, a page tensor's bytes)."""

    def __init__(self, dest: memoryview, clear_on_failure: bool = True) -> None:
        self.dest = dest
        self.clear_on_failure = clear_on_failure

    def write(self, start: int, data: memoryview) -> None:
        self.dest[start : start + len(data)] = data

    def write_all(self, data: memoryview) -> int:
        return copy_checksum_bytes(self.dest, data)

    def clear(self) -> None:
        if self.clear_on_failure:
            self.dest[:] = bytes(len(self.dest))


class ChunkedPage:
    """One page arriving as chunks. ``label`` names it in errors; ``malformed`` is raised
    for chunks out of order or past the page's length, PageCorrupt for a bad checksum."""

    def __init__(self, key: bytes, page_bytes: int, expected: int, sink: PageSink | None, label: str,
                 malformed: type[KVStoreError]) -> None:
        self.key = key
        self.page_bytes = page_bytes
        self.expected = expected
        self.sink = sink
        self.label = label
        self.malformed = malformed
        self.filled = 0
        self._hash = checksummer()

    def add(self, chunk: WireChunk) -> bool:
        """Takes the next chunk; True when the page is complete and its checksum holds."""
        if chunk.key != self.key or chunk.offset != self.filled:
            raise self.malformed(f"out-of-order chunk of {self.label}: at offset {chunk.offset}, expected {self.filled}")
        end = self.filled + len(chunk.data)
        if end > self.page_bytes:
            raise self.malformed(f"{self.label} got more than its {self.page_bytes} bytes")
        if end == self.page_bytes and self.filled == 0:  # the whole page in one chunk: copy and hash in one pass
            self.filled = end  # written, not yet verified
            digest = checksum(chunk.data) if self.sink is None else self.sink.write_all(chunk.data)
        else:
            if self.sink is not None:
                self.sink.write(self.filled, chunk.data)
            self._hash.update(chunk.data)
            self.filled = end
            if end < self.page_bytes:
                return False
            digest = self._hash.intdigest()
        if digest != self.expected:
            raise PageCorrupt(f"{self.label} failed its checksum")
        return True

    def abandon(self) -> None:
        """The stream ended or failed: unverified bytes in the sink are cleared."""
        if self.sink is not None and self.filled:
            self.sink.clear()
        self.filled = 0

    def truncated(self) -> KVStoreError:
        return self.malformed(f"{self.label} ended after {self.filled} of {self.page_bytes} bytes")
