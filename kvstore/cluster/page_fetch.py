"""What every page transport shares (UCX, TCP): the sender's view of a page it serves
(``SourcePage``, ``PageSource``) and the receiver's per-key result (``FetchStatus``,
``FetchResult``). Kept apart from the transports so a node on one data plane imports
nothing of another's library (the TCP plane needs no ``ucxx``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvstore.errors import InvalidRequest
from kvstore.page import LayoutDesc
from kvstore.page_wire.fetch_frames import (
    NO_ALLOCATION,
    PENDING,
    VERIFY,
    FetchAnswer,
    FetchRequest,
    PageEntry,
    PageStatus,
    check_keys,
)


@dataclass
class SourcePage:
    """A page the sender holds, pinned until ``release()``: ``data`` is its payload as one
    contiguous buffer, ``checksum`` the xxh3-64 its tier stored with it, ``layout`` the
    layout it was stored with (sent to a receiver that asks, so it can allocate for it).
    ``damaged(reason)``: called by a sender that found the bytes no longer match
    ``checksum`` before serving them (the tier quarantines the page)."""

    data: Any
    checksum: int
    release: Callable[[], None] = lambda: None
    layout: LayoutDesc | None = None
    damaged: Callable[[str], None] = lambda reason: None


class PageSource(Protocol):
    """What a page server serves from (the host tier, an SSD read into staging, a test's dict).
    Returns one entry per key, None for a page it does not hold; the server releases every
    page it got, also when the transfer fails."""

    async def open_pages(self, namespace_id: bytes, keys: Sequence[bytes], generation: int = 0) -> list[SourcePage | None]:
        """``generation``: the one the receiver stores the pages in (none are served of another)."""
        ...


@runtime_checkable
class BlockingPageSource(PageSource, Protocol):
    """A source that may also be opened on the caller's own thread, where it may block (the
    TCP page server's connection thread): it then takes no hop to the event loop and from
    there to a worker thread and back (DESIGN §12.7: ~0.5-2 ms of a handoff's fixed cost on a
    busy 2-core host). Thread-safe; same answer as ``open_pages``."""

    def open_pages_now(self, namespace_id: bytes, keys: Sequence[bytes], generation: int = 0) -> list[SourcePage | None]: ...


@runtime_checkable
class PendingSource(Protocol):
    """A source that also serves pages of an allocation not committed yet (fetch_frames.PENDING: a
    handoff's layers as the prefill computes them, DESIGN §12.7): ``data`` the slot, ``checksum`` 0.
    None for a key the allocation has no slot for, all None when the allocation is gone or is not
    of the namespace and ``generation``. On the caller's thread (it may take a lock)."""

    def open_pending_now(self, namespace_id: bytes, keys: Sequence[bytes], allocation: bytes,
                         generation: int = 0) -> list[SourcePage | None]: ...


def open_pending(source: object, request: FetchRequest) -> list[SourcePage | None]:
    """``source``'s pending pages of ``request`` (none from a source that serves none)."""
    if not isinstance(source, PendingSource):
        return [None] * len(request.keys)
    return source.open_pending_now(request.namespace_id, request.keys, request.allocation, request.generation)


class FetchStatus(enum.Enum):
    OK = "ok"            # the page's bytes are in its buffer and match the stored checksum (hashed=False: unchecked)
    MISSING = "missing"  # the sender does not hold it (or not at the posted size)
    CORRUPT = "corrupt"  # bytes arrived but failed the checksum: the buffer holds garbage
    FAILED = "failed"    # the transfer broke or timed out before this page arrived


@dataclass
class FetchResult:
    statuses: list[FetchStatus]
    error: str | None = None  # why the transfer broke, when it did
    checksums: list[int] = field(default_factory=list)  # per key: the checksum its OK bytes matched

    @property
    def prefix(self) -> int:
        """How many leading pages arrived whole and verified."""
        n = 0
        while n < len(self.statuses) and self.statuses[n] is FetchStatus.OK:
            n += 1
        return n


def answer_for(request: FetchRequest, pages: Sequence[SourcePage | None]) -> FetchAnswer:
    """The answer a sender gives to ``request`` for the pages its source opened: FOUND (with
    the stored checksum) for a page of the posted size, WRONG_SIZE (never sent) for another
    size, MISSING for none; the first layout known goes along (for a DESCRIBE)."""
    entries = []
    for page in pages:
        if page is None:
            entries.append(PageEntry(PageStatus.MISSING))
        elif (size := memoryview(page.data).nbytes) != request.page_bytes:
            entries.append(PageEntry(PageStatus.WRONG_SIZE, size))
        else:
            entries.append(PageEntry(PageStatus.FOUND, request.page_bytes, page.checksum))
    layout = next((p.layout for p in pages if p is not None and p.layout is not None), None)
    return FetchAnswer(request.request_id, tuple(entries), layout)


def fetch_flags(verify: bool, hashed: bool, offset: int, page_bytes: int, allocation: bytes) -> int:
    """A fetcher's request flags (either transport); InvalidRequest for a range asked hashed or
    verified (a checksum covers the whole page)."""
    pending = allocation != NO_ALLOCATION
    if (offset or page_bytes or pending) and (verify or hashed):
        raise InvalidRequest("a fetch of a range lands unhashed, unverified: a checksum covers the whole page")
    return (VERIFY if verify else 0) | (PENDING if pending else 0)


def start_fetch(request_id: int, namespace_id: bytes, keys: Sequence[bytes], dests: Sequence[Any], generation: int = 0,
                flags: int = 0, offset: int = 0, page_bytes: int = 0,
                allocation: bytes = NO_ALLOCATION) -> tuple[FetchRequest, list[memoryview], FetchResult]:
    """What a fetcher checks and builds before it asks (either transport): the request, one
    writable byte view of the page size per key (with ``offset`` or ``page_bytes``: of the range of
    each ``page_bytes`` page from ``offset`` on, that long; InvalidRequest otherwise), and a result
    that says FAILED for every page until the page arrives verified."""
    check_keys(namespace_id, keys)
    views = [memoryview(d).cast("B") for d in dests]
    if len(views) != len(keys) or any(v.readonly or v.nbytes != views[0].nbytes for v in views):
        raise InvalidRequest("fetch needs one writable destination of the page size per key")
    size = views[0].nbytes
    whole = page_bytes or size + offset
    if not 0 <= offset < whole or size > whole - offset:
        raise InvalidRequest(f"a range of {size} bytes from byte {offset} of {whole}-byte pages")
    request = FetchRequest(request_id, namespace_id, whole, tuple(keys), flags, generation, offset,
                           size if size + offset != whole else 0, allocation)
    return request, views, FetchResult([FetchStatus.FAILED] * len(keys), checksums=[0] * len(keys))
