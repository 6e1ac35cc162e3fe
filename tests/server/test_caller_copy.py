"""A handoff's push at the decode node (``caller_copy.copy_on_caller``, DESIGN §12.7): the landing's
allocation and commit on the calling thread, only the transfer on the loop. The pages land
bit-exact; a copy cut at its deadline, one whose holder lacks pages, and one overtaken by an
invalidation leave no allocation, slot or pin behind, and store nothing of an older generation.
Real servers and a real TCP page server on the holder's core; the loop is the test's own."""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from support.tcp_proxy import TcpProxy
from test_remote_landing import PAGE_BYTES, _found, _store
from test_remote_landing_tcp import Peer, _pages_at, _setup

from kvstore.cluster.transport_tcp import TcpPageFetcher, TcpPageServer
from kvstore.page import LayoutDesc
from kvstore.server.cluster.caller_copy import copy_on_caller
from kvstore.server.cluster.landing import NodeLanding
from kvstore.server.cluster.loop_calls import run_on
from kvstore.server.cluster.remote import RemoteTier
from kvstore.server.cluster.source import CorePageSource

T = TypeVar("T")


class Runtime:
    """What ``copy_on_caller`` uses of a ClusterRuntime: the receiver's core and remote tier, the
    holder as its one peer, and calls into the running loop (the test's)."""

    def __init__(self, core: Any, peer: Peer) -> None:
        self.core = core
        self.peers = {"holder": peer}
        self.remote = RemoteTier(core, self.peers, None, "tcp")  # type: ignore[arg-type]
        self._loop = asyncio.get_running_loop()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float, to_end: bool = False) -> T:
        return run_on(self._loop, coro, timeout_s, to_end)


class Threads(NodeLanding):
    """The node's landing, noting the thread of each allocation and commit; ``invalidate``: the
    namespace enters a new generation just before the commit (an invalidation overtaking the copy)."""

    def __init__(self, core: Any, invalidate: bool = False) -> None:
        super().__init__(core)
        self.invalidate = invalidate
        self.threads: list[int] = []

    def allocate(self, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes],
                 generation: int) -> tuple[bytes, list[tuple[bytes, int | None]]]:
        self.threads.append(threading.get_ident())
        return super().allocate(namespace_id, layout, keys, generation)

    def commit(self, allocation_id: bytes, keys: list[bytes], checksums: list[int]) -> int:
        self.threads.append(threading.get_ident())
        if self.invalidate:
            self.core.invalidate(self.core.leases.allocation(allocation_id).namespace_id, [])
        return super().commit(allocation_id, keys, checksums)


@asynccontextmanager
async def holder_link(holder: Any, receiver: Any, held: bool = False,
                      fetcher: type[TcpPageFetcher] = TcpPageFetcher) -> AsyncIterator[Runtime]:
    """The receiver's runtime with the holder's real TCP page server as its one peer, all closed
    on exit; ``held``: through a link that keeps the holder's bytes back (a stalled holder);
    ``fetcher``: the receiver's fetcher class."""
    server = TcpPageServer(CorePageSource(holder.core))
    port = await server.start()
    link = TcpProxy(("127.0.0.1", port)) if held else None
    if link is not None:
        link.hold()
        port = link.port
    peer = Peer(port)
    if fetcher is not TcpPageFetcher:
        peer.fetcher = fetcher("127.0.0.1", port)
    try:
        yield Runtime(receiver.core, peer)
    finally:
        if link is not None:
            link.release()
        await peer.fetcher.close()
        if link is not None:
            link.close()
        await server.close()


def _copy(runtime: Runtime, ns: bytes, keys: list[bytes], landing: NodeLanding, wait_s: float = 10.0) -> tuple[int | None, int]:
    """copy_on_caller on this (worker) thread: its answer, and this thread's id."""
    return copy_on_caller(runtime, "holder", ns, keys, PAGE_BYTES, wait_s, wait_s, landing), threading.get_ident()  # type: ignore[arg-type]


def _nothing_held(core: Any) -> None:
    counts = core.view()
    assert counts.num_allocations == 0 and not counts.lease_ids and not counts.pinned, "the copy left something held"


def _known_here(receiver: Any, ns: bytes) -> None:
    """One page of the namespace stored at the receiver: its layout is known here (a second handoff)."""
    _store(receiver.address, ns, [secrets.token_bytes(16)], [secrets.token_bytes(PAGE_BYTES)])


async def test_the_pages_land_bit_exact_allocated_and_committed_on_the_calling_thread(server_factory, tmp_path: Path) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    _known_here(receiver, ns)
    landing = Threads(receiver.core)
    async with holder_link(holder, receiver) as runtime:
        held, caller = await asyncio.to_thread(_copy, runtime, ns, keys, landing)
        assert held == 4 and landing.threads == [caller, caller] and runtime.remote.num_fetched == 4
        assert await asyncio.to_thread(_pages_at, receiver.address, ns, keys) == b"".join(pages)
        assert (await asyncio.to_thread(_copy, runtime, ns, keys, landing))[0] == 4
        assert len(landing.threads) == 2, "pages held already are not fetched again"
        _nothing_held(receiver.core)
        _nothing_held(holder.core)


async def test_a_namespace_whose_layout_is_not_known_here_takes_the_loop_path(server_factory, tmp_path: Path) -> None:
    holder, receiver, ns, keys, _ = await _setup(server_factory, tmp_path, 2)
    async with holder_link(holder, receiver) as runtime:
        assert (await asyncio.to_thread(_copy, runtime, ns, keys, Threads(receiver.core)))[0] is None
        _nothing_held(receiver.core)


async def test_pages_the_holder_lacks_end_the_copy_and_leave_no_slot(server_factory, tmp_path: Path) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 2)
    _known_here(receiver, ns)
    wanted = [*keys, secrets.token_bytes(16), secrets.token_bytes(16)]  # the holder has only the first two
    async with holder_link(holder, receiver) as runtime:
        held, _ = await asyncio.to_thread(_copy, runtime, ns, wanted, Threads(receiver.core))
        assert held == 2 and _found(receiver.address, ns, wanted) == 2
        assert await asyncio.to_thread(_pages_at, receiver.address, ns, keys) == b"".join(pages)
        _nothing_held(receiver.core)


async def test_a_copy_cut_at_its_deadline_gives_back_its_slots(server_factory, tmp_path: Path) -> None:
    holder, receiver, ns, keys, _ = await _setup(server_factory, tmp_path, 3)
    _known_here(receiver, ns)
    async with holder_link(holder, receiver, held=True) as runtime:  # the holder's bytes never come
        with pytest.raises(TimeoutError):
            await asyncio.to_thread(_copy, runtime, ns, keys, Threads(receiver.core), 0.5)
        assert _found(receiver.address, ns, keys) == 0
        _nothing_held(receiver.core)


async def test_an_invalidation_overtaking_the_copy_stores_nothing_of_the_old_generation(server_factory, tmp_path: Path) -> None:
    holder, receiver, ns, keys, _ = await _setup(server_factory, tmp_path, 3)
    _known_here(receiver, ns)
    async with holder_link(holder, receiver) as runtime:
        held, _ = await asyncio.to_thread(_copy, runtime, ns, keys, Threads(receiver.core, invalidate=True))
        assert held == 0 and _found(receiver.address, ns, keys) == 0
        assert runtime.remote.num_fetched == 0, "pages the invalidation dropped counted as fetched"
        _nothing_held(receiver.core)
