"""A copy of many batches from one holder over the TCP plane (``RemoteTier.fetch_from``: a live
migration's rounds, a replica, a handoff's push) commits each batch while the next one arrives,
not in series with it (DESIGN §12.8): a commit publishes ~1,000 pages in ~20 ms here, as long as
such a batch takes to arrive at 25 GB/s. What counts is still the leading pages held: a batch
that falls short at its commit ends the copy there, and the batch landed behind it is dropped.
Real servers and a real TCP page server on the holder's core."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from test_remote_landing import PAGE_BYTES, _found
from test_remote_landing_tcp import Peer, _pages_at, _setup

from kvstore.cluster.transport_tcp import TcpPageServer
from kvstore.page import LayoutDesc
from kvstore.server.cluster import remote
from kvstore.server.cluster.remote import NodeLanding, RemoteTier
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
