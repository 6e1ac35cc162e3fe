"""A copy of many batches from one holder over the TCP plane (``RemoteTier.fetch_from``: a live
migration's rounds, a replica, a handoff's push) commits each batch while the next one arrives,
not in series with it (DESIGN §12.8): a commit publishes ~1,000 pages in ~20 ms here, as long as
such a batch takes to arrive at 25 GB/s. What counts is still the leading pages held: a batch
that falls short at its commit ends the copy there, and the batch landed behind it is dropped.
Real servers and a real TCP page server on the holder's core."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from test_remote_landing import PAGE_BYTES, _found
from test_remote_landing_tcp import Peer, _pages_at, _setup

from kvstore.cluster.transport_tcp import TcpPageServer
from kvstore.errors import LeaseExpired
from kvstore.page import LayoutDesc
from kvstore.server.cluster import remote
from kvstore.server.cluster.landing import NodeLanding
from kvstore.server.cluster.remote import RemoteTier
from kvstore.server.cluster.source import CorePageSource

WAIT_S = 30.0  # only a copy that never asks for the next batch while one commits waits this long


class Watched(NodeLanding):
    """The receiver's own landing, which records the order of allocations and commits. The first
    commit waits (on its worker thread) until the next batch's slots are asked for; ``short``:
    it commits only the first page of its batch."""

    def __init__(self, core: Any, short: bool = False) -> None:
        super().__init__(core)
        self.short = short
        self.events: list[str] = []
        self._second = threading.Event()

    def allocate(self, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes],
                 generation: int) -> tuple[bytes, list[tuple[bytes, int | None]]]:
        self.events.append("allocate")
        if self.events.count("allocate") == 2:
            self._second.set()
        return super().allocate(namespace_id, layout, keys, generation)

    def commit(self, allocation_id: bytes, keys: list[bytes], checksums: list[int]) -> int:
        first = "commit" not in self.events
        self.events.append("commit")
        if first:
            if not self._second.wait(WAIT_S):
                raise AssertionError("the next batch was not asked for while this one committed")
            if self.short:
                keys, checksums = keys[:1], checksums[:1]
        held = super().commit(allocation_id, keys, checksums)
        self.events.append("committed")
        return held


class OnePeer:
    def __init__(self, peer: Peer) -> None:
        self.peer = peer

    def get(self, node: str) -> Peer:
        return self.peer


async def _copy(holder: Any, receiver: Any, ns: bytes, keys: list[bytes], landing: Watched) -> int:
    server = TcpPageServer(CorePageSource(holder.core))
    port = await server.start()
    try:
        peer = Peer(port)
        tier = RemoteTier(receiver.core, OnePeer(peer), None, "tcp")  # type: ignore[arg-type]
        got = await tier.fetch_from("holder", ns, keys, PAGE_BYTES, 60.0, "", landing)
        await peer.fetcher.close()
        return got
    finally:
        await server.close()


async def test_a_batch_commits_while_the_next_one_arrives(server_factory, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "FETCH_PAGES", 2)
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 5)
    landing = Watched(receiver.core)
    assert await _copy(holder, receiver, ns, keys, landing) == 5
    assert landing.events.count("allocate") == 3 and landing.events.count("commit") == 3
    first = landing.events.index("committed")
    assert landing.events[:first].count("allocate") == 2, "the second batch is asked for before the first is committed"
    assert _pages_at(receiver.address, ns, keys) == b"".join(pages)


async def test_a_batch_short_at_its_commit_ends_the_copy_and_the_next_is_dropped(server_factory, tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "FETCH_PAGES", 2)
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 6)
    landing = Watched(receiver.core, short=True)
    assert await _copy(holder, receiver, ns, keys, landing) == 1
    assert landing.events.count("commit") == 1, "the batch landed behind the short one is not committed"
    assert _found(receiver.address, ns, keys) == 1
    assert _found(receiver.address, ns, keys[2:]) == 0
    assert _pages_at(receiver.address, ns, keys[:1]) == pages[0]


class Expiring(NodeLanding):
    """The receiver's own landing whose first batch's allocation is gone by its commit (as at its ttl:
    the real commit raises LeaseExpired); ``gate``: that commit first waits until it is opened."""

    def __init__(self, core: Any, gate: threading.Event | None = None) -> None:
        super().__init__(core)
        self.gate = gate
        self.failed = threading.Event()

    def commit(self, allocation_id: bytes, keys: list[bytes], checksums: list[int]) -> int:
        if self.gate is not None:
            self.gate.wait(WAIT_S)
        self.core.abort(allocation_id)
        try:
            return super().commit(allocation_id, keys, checksums)
        finally:
            self.failed.set()


async def _copying(holder: Any, receiver: Any, ns: bytes, keys: list[bytes], landing: NodeLanding,
                   cut: Any = None) -> int:
    """``_copy`` that survives the copy's failure; ``cut(task)``: awaited beside the copy, to cancel it."""
    server = TcpPageServer(CorePageSource(holder.core))
    port = await server.start()
    peer = Peer(port)
    try:
        tier = RemoteTier(receiver.core, OnePeer(peer), None, "tcp")  # type: ignore[arg-type]
        task = asyncio.ensure_future(tier.fetch_from("holder", ns, keys, PAGE_BYTES, 60.0, "", landing))
        if cut is not None:
            await cut(task)
        return await task
    finally:
        await peer.fetcher.close()
        await server.close()


def _settled(receiver: Any) -> None:
    counts = receiver.core.leases.counts()
    assert counts.num_allocations == 0, "a landed batch stayed reserved"
    assert not counts.pinned and not counts.moving, "a page stayed pinned"


async def test_a_commit_failing_behind_a_landed_batch_gives_that_batch_back(server_factory, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The first batch's commit fails (its allocation expired) while the second landed: the copy ends
    with nothing stored, and the second batch's slots are given back at once, not at their ttl."""
    monkeypatch.setattr(remote, "FETCH_PAGES", 2)
    holder, receiver, ns, keys, _ = await _setup(server_factory, tmp_path, 6)
    landing = Expiring(receiver.core)
    with pytest.raises(LeaseExpired):
        await _copying(holder, receiver, ns, keys, landing)
    _settled(receiver)
    assert _found(receiver.address, ns, keys) == 0
    assert receiver.core.view().tiers["host"].num_pages == 0, "the landed batch's slots were freed"


def _awaits_a_commit(task: asyncio.Task[int]) -> bool:
    """Whether the copy waits on its last batch's commit (the future a task waits on: CPython's Task)."""
    waiter = getattr(task, "_fut_waiter", None)
    return isinstance(waiter, asyncio.Task) and waiter.get_coro().__qualname__.endswith("._commit")  # type: ignore[union-attr]


async def test_a_copy_cut_while_it_waits_on_a_commit_gives_the_landed_batch_back(server_factory, tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is cancelled (its caller's deadline, a migration's abort) while the second batch has
    landed and the first batch's commit runs: the second batch's slots are given back."""
    monkeypatch.setattr(remote, "FETCH_PAGES", 2)
    holder, receiver, ns, keys, _ = await _setup(server_factory, tmp_path, 6)
    gate = threading.Event()
    landing = Expiring(receiver.core, gate)

    async def cut(task: asyncio.Task[int]) -> None:
        for _ in range(int(WAIT_S / 0.01)):
            if _awaits_a_commit(task) or task.done():
                break
            await asyncio.sleep(0.01)
        assert _awaits_a_commit(task), "the copy never waited on a commit with the next batch landed"
        task.cancel()
        gate.set()

    with pytest.raises(asyncio.CancelledError):
        await _copying(holder, receiver, ns, keys, landing, cut)
    assert await asyncio.to_thread(landing.failed.wait, WAIT_S)
    await asyncio.sleep(0.1)  # the cancelled copy's own clean-up, if any, runs on this loop
    _settled(receiver)
    assert receiver.core.view().tiers["host"].num_pages == 0


class HeldAtTheCut(NodeLanding):
    """The receiver's own landing: the first batch's commit waits for ``gate``; the second batch's
    allocation waits until the landing is told the copy was cut (``cut()``), having said it started
    (``second``)."""

    def __init__(self, core: Any) -> None:
        super().__init__(core)
        self.gate, self.told_cut, self.second = threading.Event(), threading.Event(), threading.Event()
        self.allocations = 0

    def allocate(self, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes],
                 generation: int) -> tuple[bytes, list[tuple[bytes, int | None]]]:
        self.allocations += 1
        if self.allocations == 2:
            self.second.set()
            assert self.told_cut.wait(WAIT_S), "the landing was never told the copy was cut"
        return super().allocate(namespace_id, layout, keys, generation)

    def commit(self, allocation_id: bytes, keys: list[bytes], checksums: list[int]) -> int:
        assert self.gate.wait(WAIT_S), "the test never let the commit go"
        return super().commit(allocation_id, keys, checksums)

    def cut(self) -> None:
        self.told_cut.set()


async def test_a_copy_cut_while_the_next_batch_lands_ends_after_the_commit_in_flight(server_factory, tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is cut while the first batch commits and the second is being allocated: it ends only
    once that commit has (its caller then answers, and settles the namespace's binding, on what was
    stored: tests/cluster/test_cut_copy_binding.py), with the first batch stored and the second's
    slots given back. Before, the commit ran on after the cancelled copy had ended."""
    monkeypatch.setattr(remote, "FETCH_PAGES", 2)
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    landing = HeldAtTheCut(receiver.core)

    async def cut(task: asyncio.Task[int]) -> None:
        assert await asyncio.to_thread(landing.second.wait, WAIT_S), "the second batch was never allocated"
        task.cancel()  # the fetch tells the landing (cut()), which lets the second allocation end
        try:
            done, _ = await asyncio.wait([task], timeout=0.2)
            assert not done, "the cut copy ended while its first batch's commit still ran"
        finally:
            landing.gate.set()

    with pytest.raises(asyncio.CancelledError):
        await _copying(holder, receiver, ns, keys, landing, cut)
    _settled(receiver)
    assert _found(receiver.address, ns, keys) == 2
    assert _pages_at(receiver.address, ns, keys[:2]) == b"".join(pages[:2])
    assert receiver.core.view().tiers["host"].num_pages == 2, "the second batch's slots were given back"
