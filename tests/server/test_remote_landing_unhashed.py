"""A handoff's pages land at the decode node unhashed (DESIGN §4: the copy out of the arena that
consumes a page is its one check): a page scribbled on in the holder's arena lands and is findable
at the receiver, but none of its readers there serves it. gRPC's send checks it and quarantines
it; a third node fetching it (hashed, the default) finds it CORRUPT, asks again with the holder
verifying, and the receiver quarantines its copy. Real servers, a real TCP or UCX page server on
each holder's core, over loopback."""

from __future__ import annotations

from typing import Any

import pytest
from support.servers import flip_arena_byte, make_config
from test_remote_landing import PAGE_BYTES, _found
from test_remote_landing_tcp import _pages_at, _setup

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


async def _fetch(plane: str, holder: Any, receiver: Any, ns: bytes, keys: list[bytes], hashed: bool) -> int:
    server, port = await _serve(plane, holder)
    try:
        peer = Peer(plane, port)
        tier = RemoteTier(receiver.core, None, None, plane)  # type: ignore[arg-type]  # no cluster: the peer is given
        got = await tier._fetch_posted(peer, ns, keys, PAGE_BYTES, 10.0, hashed=hashed)  # type: ignore[arg-type]
        await peer.fetcher.close()
        return got
    finally:
        await server.close()


@pytest.mark.parametrize("plane", ["tcp", "ucx"])
async def test_unhashed_pages_land_and_the_gRPC_send_quarantines_a_damaged_one(server_factory, tmp_path, plane: str) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    flip_arena_byte(holder, holder.core.where(keys[2])["host"] + 100)  # a client that maps the arena scribbles
    assert await _fetch(plane, holder, receiver, ns, keys, hashed=False) == 4
    assert _found(receiver.address, ns, keys) == 4  # landed unchecked, findable ...
    assert _pages_at(receiver.address, ns, keys) == pages[0] + pages[1]  # ... but never served
    assert keys[2] in {q.key for q in receiver.core.quarantined()}
    assert _found(receiver.address, ns, keys) == 2


@pytest.mark.parametrize("plane", ["tcp", "ucx"])
async def test_a_node_fetching_a_damaged_unhashed_landing_has_it_quarantined_where_it_landed(server_factory, tmp_path,
                                                                                               plane: str) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    flip_arena_byte(holder, holder.core.where(keys[1])["host"] + 7)
    assert await _fetch(plane, holder, receiver, ns, keys, hashed=False) == 4
    third = server_factory(make_config(tmp_path / "third"))
    assert await _fetch(plane, receiver, third, ns, keys, hashed=True) == 1  # page 1 CORRUPT, then not sent
    assert keys[1] in {q.key for q in receiver.core.quarantined()}
    assert _found(receiver.address, ns, keys) == 1 and _found(third.address, ns, keys) == 1
    assert _pages_at(third.address, ns, keys) == pages[0]


@pytest.mark.parametrize("plane", ["tcp", "ucx"])
async def test_sound_pages_land_unhashed_bit_exact(server_factory, tmp_path, plane: str) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    assert await _fetch(plane, holder, receiver, ns, keys, hashed=False) == 4
    assert _pages_at(receiver.address, ns, keys) == b"".join(pages)
    assert receiver.core.quarantined() == []
