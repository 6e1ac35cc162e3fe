"""Pages fetched from another node land unhashed (DESIGN §4: the copy that consumes a page is its
one check): a page scribbled on in the holder's arena lands and is findable at the receiver, but
none of its readers there serves it. gRPC's send checks it and quarantines it, and the holder is
then asked to check its own copy, which it quarantines; fetched on by a third node, the damage is
dropped at every node it passed through. Real servers, a real TCP or UCX page server on each
holder's core, over loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support.servers import flip_arena_byte, make_config
from test_remote_landing import PAGE_BYTES, _found
from test_remote_landing_tcp import _checks_done, _pages_at, _setup

from kvstore.cluster.transport_tcp import TcpPageFetcher, TcpPageServer
from kvstore.cluster.transport_ucx import UcxConfig, UcxPageFetcher, UcxPageServer
from kvstore.server.cluster.remote import RemoteTier
from kvstore.server.cluster.source import CorePageSource

UCX = UcxConfig(tls="tcp", progress_mode="blocking")  # tests/cluster's: UCX reads its config once per process


class Peer:
    """A holder as ``RemoteTier`` calls it on the UCX or TCP plane: only its fetcher."""

    def __init__(self, plane: str, port: int) -> None:
        self.fetcher = TcpPageFetcher("127.0.0.1", port) if plane == "tcp" else UcxPageFetcher("127.0.0.1", port, UCX)
        self.member = type("Member", (), {"node_id": "holder"})()


async def _serve(plane: str, holder: Any) -> tuple[Any, int]:
    server = TcpPageServer(CorePageSource(holder.core)) if plane == "tcp" else UcxPageServer(CorePageSource(holder.core), UCX)
    return server, await server.start()


async def _fetch(plane: str, holder: Any, receiver: Any, ns: bytes, keys: list[bytes]) -> int:
    server, port = await _serve(plane, holder)
    try:
        peer = Peer(plane, port)
        tier = RemoteTier(receiver.core, None, None, plane)  # type: ignore[arg-type]  # no cluster: the peer is given
        got = await tier._fetch_posted(peer, ns, keys, PAGE_BYTES, 10.0)  # type: ignore[arg-type]
        await peer.fetcher.close()
        return got
    finally:
        await server.close()


async def _quarantined(server: Any, key: bytes) -> bool:
    for _ in range(200):
        if key in {q.key for q in server.core.quarantined()}:
            return True
        await asyncio.sleep(0.025)
    return False


@pytest.mark.parametrize("plane", ["tcp", "ucx"])
async def test_unhashed_pages_land_the_gRPC_send_quarantines_a_damaged_one_and_its_source_checks_its_own(
        server_factory, tmp_path, plane: str) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    flip_arena_byte(holder, holder.core.where(keys[2])["host"] + 100)  # a client that maps the arena scribbles
    server, port = await _serve(plane, holder)
    try:
        peer = Peer(plane, port)
        tier = RemoteTier(receiver.core, {"holder": peer}, None, plane)  # type: ignore[arg-type]  # the peers: the holder alone
        assert await tier._fetch_posted(peer, ns, keys, PAGE_BYTES, 10.0) == 4  # type: ignore[arg-type]
        assert _found(receiver.address, ns, keys) == 4  # landed unchecked, findable ...
        assert holder.core.quarantined() == []
        read = await asyncio.to_thread(_pages_at, receiver.address, ns, keys)
        assert read == pages[0] + pages[1]  # ... but never served
        assert keys[2] in {q.key for q in receiver.core.quarantined()}
        assert _found(receiver.address, ns, keys) == 2
        assert await _quarantined(holder, keys[2]), "the source was not asked to check its copy, or did not drop it"
        assert _found(holder.address, ns, keys) == 2
        assert tier.source_checks.num_asked == 1
        await peer.fetcher.close()
    finally:
        await server.close()


@pytest.mark.parametrize("plane", ["tcp", "ucx"])
async def test_a_page_damaged_on_the_way_is_dropped_where_it_landed_and_its_sound_source_kept(server_factory, tmp_path,
                                                                                              plane: str) -> None:
    """The damage was on the receiver's copy alone (here: scribbled on after it landed): the
    source checks its copy, finds it sound, and keeps serving it."""
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 3)
    server, port = await _serve(plane, holder)
    try:
        peer = Peer(plane, port)
        tier = RemoteTier(receiver.core, {"holder": peer}, None, plane)  # type: ignore[arg-type]
        assert await tier._fetch_posted(peer, ns, keys, PAGE_BYTES, 10.0) == 3  # type: ignore[arg-type]
        flip_arena_byte(receiver, receiver.core.where(keys[1])["host"] + 5)
        assert await asyncio.to_thread(_pages_at, receiver.address, ns, keys) == pages[0]
        await _checks_done(tier)
        assert tier.source_checks.num_asked == 1 and holder.core.quarantined() == []
        assert _found(holder.address, ns, keys) == 3
        assert await tier._fetch_posted(peer, ns, keys, PAGE_BYTES, 10.0) == 3  # type: ignore[arg-type]
        assert await asyncio.to_thread(_pages_at, receiver.address, ns, keys) == b"".join(pages)
        await peer.fetcher.close()
    finally:
        await server.close()


@pytest.mark.parametrize("plane", ["tcp", "ucx"])
async def test_damage_fetched_on_by_a_third_node_is_dropped_at_every_node_it_passed(server_factory, tmp_path,
                                                                                    plane: str) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    flip_arena_byte(holder, holder.core.where(keys[1])["host"] + 7)
    third = server_factory(make_config(tmp_path / "third"))
    holder_server, holder_port = await _serve(plane, holder)
    receiver_server, receiver_port = await _serve(plane, receiver)
    try:
        from_holder, from_receiver = Peer(plane, holder_port), Peer(plane, receiver_port)
        from_receiver.member = type("Member", (), {"node_id": "receiver"})()
        at_receiver = RemoteTier(receiver.core, {"holder": from_holder}, None, plane)  # type: ignore[arg-type]
        at_third = RemoteTier(third.core, {"receiver": from_receiver}, None, plane)  # type: ignore[arg-type]
        assert await at_receiver._fetch_posted(from_holder, ns, keys, PAGE_BYTES, 10.0) == 4  # type: ignore[arg-type]
        assert await at_third._fetch_posted(from_receiver, ns, keys, PAGE_BYTES, 10.0) == 4  # type: ignore[arg-type]
        assert await asyncio.to_thread(_pages_at, third.address, ns, keys) == pages[0]  # never served ...
        for server in (third, receiver, holder):  # ... and dropped where it landed, where it came from, and at its source
            assert await _quarantined(server, keys[1])
        assert [_found(s.address, ns, keys) for s in (holder, receiver, third)] == [1, 1, 1]
        await from_holder.fetcher.close()
        await from_receiver.fetcher.close()
    finally:
        await receiver_server.close()
        await holder_server.close()


@pytest.mark.parametrize("plane", ["tcp", "ucx"])
async def test_sound_pages_land_unhashed_bit_exact(server_factory, tmp_path, plane: str) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    assert await _fetch(plane, holder, receiver, ns, keys) == 4
    assert _pages_at(receiver.address, ns, keys) == b"".join(pages)
    assert receiver.core.quarantined() == []
