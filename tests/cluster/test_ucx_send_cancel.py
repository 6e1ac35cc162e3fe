"""A UCX page server's handler cancelled mid-answer (its server closed, or its send timeout): no page
it serves is released while a send that reads it may still be posted (DESIGN §12.3).

Bug pinned here: ``UcxPageServer._serve`` awaited its page sends through ``gather``; a cancel of the
handler went on into the sends, and ucxx cancels only a send's wait: its request stays posted and UCX
may still read the page. The abort then waited only for the sends not done (the cancelled ones were
done) and the pages went back to their tier (a slot reused by another page: the peer gets mixed bytes).

A real page server in-process and a real fetcher, UCX over loopback. Stand-ins at the server's
endpoint: each page send reports its end only once the test lets it (UCX on loopback reports an
aborted send within the abort call; with a progress thread or a real NIC it comes later), and the
handler's end is noted. The sends end within the abort's wait, or after it: then the pages are
released only as they do."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import numpy as np
import pytest
from fetch_contract import NS, key
from test_transport_ucx import TCP

from kvstore.cluster import transport_ucx
from kvstore.cluster.transport_ucx import SourcePage, UcxPageFetcher, UcxPageServer
from kvstore.page import checksum

PAGES, PAGE_BYTES = 8, 1 << 20
ABORT_WAIT_S = 0.5  # the abort's wait for the sends (2 s in production): the test waits it out where they end after it
TIMEOUT_S = 1.0  # the server's send timeout, where it is what cuts the answer
WAIT_S = 30.0  # only a broken server makes the test wait this long


class HeldSource:
    """Serves ``PAGES`` distinct pages (key(i): page i), each pinned until released; notes a page
    released while a send that reads it has not reported its end."""

    def __init__(self) -> None:
        self.pages = [np.full(PAGE_BYTES, i + 1, np.uint8) for i in range(PAGES)]
        self.reading = [0] * PAGES  # per page: its sends posted whose end was not reported yet
        self.releases = [0] * PAGES
        self.early: list[int] = []  # pages released while a send read them
        self.pinned = 0
        self.all_released = asyncio.Event()

    def index(self, buffer: Any) -> int:
        return next(i for i, page in enumerate(self.pages) if page is buffer)

    async def open_pages(self, namespace_id: bytes, keys: Sequence[bytes], generation: int = 0) -> list[SourcePage | None]:
        self.pinned += len(keys)
        opened: list[SourcePage | None] = []
        for k in keys:
            data = self.pages[int.from_bytes(k[1:], "little")]
            opened.append(SourcePage(data, checksum(data), partial(self._release, self.index(data))))
        return opened

    def _release(self, i: int) -> None:
        if self.reading[i]:
            self.early.append(i)
        self.releases[i] += 1
        self.pinned -= 1
        if self.pinned == 0:
            self.all_released.set()


class _Held:
    """The server's UCX endpoint: a page send reports its end only once the server's ``gate`` is
    open; a cancel ends it at once, as it ends ucxx's wait (whose request stays posted, reading)."""

    def __init__(self, ep: Any, server: HeldServer) -> None:
        self._ep, self._server = ep, server

    def send(self, buffer: Any) -> Any:
        if len(buffer) != PAGE_BYTES:  # a frame's
            return self._ep.send(buffer)
        server = self._server
        i = server.source.index(buffer)
        server.source.reading[i] += 1
        server.sends.append(send := asyncio.ensure_future(self._reported_late(self._ep.send(buffer), i)))
        if len(server.sends) == PAGES:
            server.posted.set()
        return send

    async def _reported_late(self, send: Any, i: int) -> Any:
        server, ended = self._server, False
        try:
            try:
                result = await send
            except asyncio.CancelledError:
                raise
            except BaseException:  # aborted
                await server.gate.wait()
                ended = True
                raise
            await server.gate.wait()
            ended = True
            return result
        finally:
            if ended:
                server.source.reading[i] -= 1
            else:  # its wait cut: nothing waits for its request's end any more
                server.num_cut += 1

    def abort(self) -> None:
        self._server.aborted.set()
        self._ep.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ep, name)


class HeldServer(UcxPageServer):
    """The UCX page server on a ``_Held`` endpoint; notes when its connection's handler has ended."""

    def __init__(self, source: HeldSource, send_timeout_s: float) -> None:
        super().__init__(source, TCP, send_timeout_s=send_timeout_s)
        self.source = source
        self.sends: list[asyncio.Future[Any]] = []
        self.num_cut = 0
        self.posted, self.aborted, self.ended, self.gate = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.closing: asyncio.Future[None] | None = None  # a close() the test started

    def close_now(self) -> None:
        self.closing = asyncio.ensure_future(self.close())

    async def _on_connect(self, ep: Any) -> None:
        try:
            await super()._on_connect(_Held(ep, self))
        finally:
            self.ended.set()


@asynccontextmanager
async def answering(source: HeldSource, send_timeout_s: float, verify: bool) -> AsyncIterator[HeldServer]:
    """A ``HeldServer`` on ``source``, answering a fetch of ``PAGES`` pages; at the end its sends are let go,
    the server and the fetcher closed."""
    server = HeldServer(source, send_timeout_s)
    port = await server.start()
    fetcher = UcxPageFetcher("127.0.0.1", port, TCP)
    fetch = asyncio.ensure_future(fetcher.fetch(NS, [key(i) for i in range(PAGES)], [bytearray(PAGE_BYTES) for _ in range(PAGES)],
                                                timeout_s=WAIT_S, verify=verify))
    try:
        yield server
    finally:
        server.gate.set()
        if server.closing is not None:
            await asyncio.wait_for(server.closing, WAIT_S)
        await asyncio.wait_for(server.close(), WAIT_S)
        await asyncio.wait({fetch}, timeout=WAIT_S)
        await fetcher.close()


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


@pytest.mark.parametrize("cut, ends, verify", [("closed", "within-the-wait", False), ("timed-out", "within-the-wait", False),
                                               ("closed", "after-it", False), ("timed-out", "after-it", False),
                                               ("closed", "within-the-wait", True)])
async def test_no_page_is_released_while_a_send_may_read_it(monkeypatch: pytest.MonkeyPatch, cut: str, ends: str,
                                                            verify: bool) -> None:
    monkeypatch.setattr(transport_ucx, "_ABORT_WAIT_S", ABORT_WAIT_S)
    source = HeldSource()
    async with answering(source, TIMEOUT_S if cut == "timed-out" else WAIT_S, verify) as server:
        try:
            await _first(server.posted, server.ended)
            assert server.posted.is_set(), "the handler ended before every page's send was posted"
            if cut == "closed":
                server.close_now()
            await asyncio.wait_for(server.aborted.wait(), WAIT_S)
            if ends == "after-it":
                await asyncio.wait_for(server.ended.wait(), WAIT_S)
            assert not source.early, f"pages {source.early} were released while a send reading them was still posted"
        finally:
            server.gate.set()
        await asyncio.wait_for(source.all_released.wait(), WAIT_S)
        await asyncio.wait_for(server.ended.wait(), WAIT_S)
        assert server.num_cut == 0, "a send's wait was cancelled: nothing waited for its request's end"
        assert not source.early, f"pages {source.early} were released while a send reading them was still posted"
        assert source.releases == [1] * PAGES, f"pages released other than once each: {source.releases}"
