"""What a UCX page server's answer has posted that reads its pages (the page sends, the VERIFY
hashes), and when each page may go back to its tier: only once nothing posted reads it any more.
ucxx cancels only a send's wait, never its request (UCX may still read the page), so a cancel of
the handler ends the wait, never a send; after an abort a page whose reads did not end within the
wait is released as they end, never earlier (DESIGN §12.3). More: README.md (### ucx_sends.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from kvstore.cluster.page_fetch import SourcePage

logger = logging.getLogger(__name__)
_late: set[asyncio.Future[Any]] = set()  # reads that outlived their handler: kept until they end and free their page


def _settled(read: asyncio.Future[Any]) -> None:
    """Marks a read's failure retrieved, its traceback dropped: its frames would keep the page's
    buffer exported (an arena slot that cannot be unmapped) until a gc pass."""
    if not read.cancelled() and (exc := read.exception()) is not None:
        exc.__traceback__ = None


async def wait_over_cancel(futures: Sequence[asyncio.Future[Any]], wait_s: float) -> tuple[list[asyncio.Future[Any]], bool]:
    """Waits up to ``wait_s`` for ``futures`` to end, a cancel meanwhile noted rather than raised (the
    caller raises it once it has done what must follow the wait): those still running, and whether a
    cancel came. After an abort, UCX reports its requests' ends late or never (DESIGN §12.3)."""
    cancelled, end = False, time.monotonic() + wait_s
    while (still := [f for f in futures if not f.done()]) and (left := end - time.monotonic()) > 0:
        try:
            await asyncio.wait(still, timeout=left)
        except asyncio.CancelledError:
            cancelled = True
    return still, cancelled


class PageReads:
    """The reads one answer posted, per page."""

    def __init__(self) -> None:
        self._reads: dict[int, list[asyncio.Future[Any]]] = {}  # id(page) -> its reads (the pages outlive this)

    def post(self, page: SourcePage, read: asyncio.Future[Any]) -> asyncio.Future[Any]:
        self._reads.setdefault(id(page), []).append(read)
        return read

    async def ended(self) -> None:
        """Waits until every read posted has ended (raises the first failure); a cancel ends the wait only."""
        for reads in list(self._reads.values()):
            for read in reads:
                await asyncio.shield(read)

    async def after_abort(self, wait_s: float) -> None:
        """Once the connection is aborted: waits up to ``wait_s`` for every read's end; a cancel
        meanwhile is raised only once the wait is over (as UcxPageFetcher._abandon)."""
        reads = [read for reads in self._reads.values() for read in reads]
        _, cancelled = await wait_over_cancel(reads, wait_s)
        for read in reads:
            if read.done():
                _settled(read)
        if cancelled:
            raise asyncio.CancelledError

    def release(self, pages: Sequence[SourcePage | None]) -> None:
        """Releases each page now if nothing posted reads it any more, else as its last read ends."""
        late = 0
        for page in pages:
            if page is None:
                continue
            if not (reading := [r for r in self._reads.get(id(page), ()) if not r.done()]):
                page.release()
                continue
            late += 1
            _release_when_ended(page, reading)
        if late:
            logger.warning("%d pages are still read by sends posted before the connection's abort; "
                           "each goes back to its tier as they end", late)


def _release_when_ended(page: SourcePage, reading: list[asyncio.Future[Any]]) -> None:
    left = len(reading)

    def ended(read: asyncio.Future[Any]) -> None:
        nonlocal left
        _late.discard(read)
        _settled(read)
        left -= 1
        if left == 0:
            page.release()

    for read in reading:
        _late.add(read)
        read.add_done_callback(ended)
