"""A node fetching pages over the TCP data plane into its landing slots (the receive buffers
themselves). A reader's fill lands unhashed: the reader that consumes a page checks it (DESIGN
§4). A byte flipped in flight lands, is never served (the reader drops the copy) and the holder,
asked to check its own, keeps its sound one, which a second fetch lands whole; a page damaged on
the holder's disk lands, is never served, and the holder drops its read-up copy and the one on
disk. A copy that may become the only one (``fetch_from(hashed=True)``: a replica, a migration)
is checked as it lands: damage in flight is fetched again with the holder checking, damage at the
holder is quarantined there and not copied. Real servers, a real TCP page server on the holder's
core, and a relay that damages bytes on the wire."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import grpc
from support.servers import flip_arena_byte, flip_ssd_byte, make_config
from support.tcp_proxy import TcpProxy
from test_remote_landing import LAYOUT, PAGE_BYTES, _found, _store

from kvstore._proto import data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.cluster.transport_tcp import TcpPageFetcher, TcpPageServer
from kvstore.page import checksum
from kvstore.page_wire.fetch_frames import FetchAnswer, PageEntry, PageStatus
from kvstore.server.cluster.remote import RemoteTier
from kvstore.server.cluster.source import CorePageSource


class Peer:
    """The holder as ``RemoteTier`` calls it on the TCP plane: only its fetcher."""

    def __init__(self, port: int) -> None:
        self.fetcher = TcpPageFetcher("127.0.0.1", port)
        self.member = type("Member", (), {"node_id": "holder"})()


def _pages_at(address: str, ns: bytes, keys: list[bytes]) -> bytes:
    with grpc.insecure_channel(address) as channel:
        return b"".join(c.data for c in data_pb2_grpc.DataStub(channel).ReadPages(
            data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys)))


async def _setup(server_factory: Any, tmp_path: Path, n: int) -> tuple[Any, Any, bytes, list[bytes], list[bytes]]:
    holder, receiver = server_factory(), server_factory(make_config(tmp_path / "receiver"))
    ns = secrets.token_bytes(16)
    keys = [secrets.token_bytes(16) for _ in range(n)]
    pages = [secrets.token_bytes(PAGE_BYTES) for _ in keys]
    _store(holder.address, ns, keys, pages)
    return holder, receiver, ns, keys, pages


async def _serve_through_a_flipping_relay(holder: Any, ns: bytes, keys: list[bytes]) -> tuple[TcpPageServer, int, TcpProxy]:
    """The holder's TCP page server, and a relay to it that flips one byte inside page 2 of a
    fetch of ``keys`` (after the answer frame and page 1)."""
    server = TcpPageServer(CorePageSource(holder.core))
    port = await server.start()
    layout = holder.core.reads.layout_of(ns)
    answer = 8 + len(FetchAnswer(1, (PageEntry(PageStatus.FOUND, PAGE_BYTES, 0),) * len(keys), layout).encode())
    return server, port, TcpProxy(("127.0.0.1", port), flip_at=answer + PAGE_BYTES + 100)


async def test_a_page_damaged_in_flight_is_never_served_and_arrives_whole_again(server_factory, tmp_path) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    server, port, relay = await _serve_through_a_flipping_relay(holder, ns, keys)
    try:
        flipped = Peer(relay.port)
        tier = RemoteTier(receiver.core, {"holder": Peer(port)}, None, "tcp")  # type: ignore[arg-type]  # the source checks go direct
        assert await tier._fetch_posted(flipped, ns, keys, PAGE_BYTES, 10.0) == 4  # type: ignore[arg-type]
        await flipped.fetcher.close()
        # page 2 landed damaged: its reader drops it, and the pages after it are not served either
        assert await asyncio.to_thread(_pages_at, receiver.address, ns, keys) == pages[0]
        assert keys[1] in {q.key for q in receiver.core.quarantined()}
        await _checks_done(tier)
        assert tier.source_checks.num_asked == 1 and holder.core.quarantined() == []  # the holder's bytes were sound
        # fetched again (the first page is held), the plain path lands the rest bit-exact
        assert await tier._fetch_posted(Peer(port), ns, keys, PAGE_BYTES, 10.0) == 4  # type: ignore[arg-type]
        assert _pages_at(receiver.address, ns, keys) == b"".join(pages)
    finally:
        relay.close()
        await server.close()


async def _checks_done(tier: RemoteTier) -> None:
    for _ in range(400):
        if tier.source_checks.num_asked and not tier.source_checks._tasks:
            return
        await asyncio.sleep(0.025)
    raise AssertionError("no source check ran to its end")


async def test_a_page_damaged_on_the_holders_disk_is_never_served_and_dropped_there(server_factory, tmp_path, caplog) -> None:
    """A page the holder reads up from disk to send is not checked on the way up, nor as it lands
    (its reader checks it: DESIGN §4). Here the damage is on the holder's disk: the receiver's
    reader drops the copy that landed, the holder, asked to check its own, drops both its read-up
    copy and the copy on disk, where the damage is, so that no lookup promises it again."""
    holder, receiver = server_factory(), server_factory(make_config(tmp_path / "receiver"))
    ns = secrets.token_bytes(16)
    keys = [secrets.token_bytes(16) for _ in range(3)]
    pages = [secrets.token_bytes(PAGE_BYTES) for _ in keys]
    with grpc.insecure_channel(holder.address) as channel:
        stored = data_pb2_grpc.DataStub(channel).WritePages(iter([
            data_pb2.PageChunk(key=k, namespace_id=ns, layout=LAYOUT, page_bytes=PAGE_BYTES, checksum=checksum(p), data=p,
                               durable=True) for k, p in zip(keys, pages)]))
        assert stored.num_published == len(keys)
        directory_pb2_grpc.DirectoryStub(channel).Remove(directory_pb2.RemoveRequest(namespace_id=ns, keys=keys, tier="host"))
    flip_ssd_byte(holder, keys[1])  # one byte of page 1, on the holder's disk
    server = TcpPageServer(CorePageSource(holder.core))
    port = await server.start()
    try:
        peer = Peer(port)
        tier = RemoteTier(receiver.core, {"holder": peer}, None, "tcp")  # type: ignore[arg-type]
        assert await tier._fetch_posted(peer, ns, keys, PAGE_BYTES, 10.0) == 3  # type: ignore[arg-type]
        assert await asyncio.to_thread(_pages_at, receiver.address, ns, keys) == pages[0]
        await _checks_done(tier)
        assert holder.core.where(keys[1]) == {}, "neither the read-up copy nor the damaged one on disk stays"
        # the holder's answer to the check is the connection it dropped: said so, not as the transport's error alone
        assert "holder checked its copy: not sent (its check failed there and it was quarantined" in caplog.text
        assert _found(holder.address, ns, keys) == 1 and _found(receiver.address, ns, keys) == 1
        await peer.fetcher.close()
    finally:
        await server.close()


async def test_a_copy_that_may_become_the_only_one_is_checked_as_it_lands(server_factory, tmp_path) -> None:
    """``fetch_from(hashed=True)``, a replica's or a migration's copy (the holder may drop its own
    next): a page damaged in flight arrives CORRUPT, is asked for again with the holder checking it
    and arrives whole; nothing lands unchecked, so nothing is noted for a source check."""
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    server, _, relay = await _serve_through_a_flipping_relay(holder, ns, keys)
    try:
        flipped = Peer(relay.port)
        tier = RemoteTier(receiver.core, {"holder": flipped}, None, "tcp")  # type: ignore[arg-type]
        assert await tier.fetch_from("holder", ns, keys, PAGE_BYTES, 10.0, "", hashed=True) == 4
        await flipped.fetcher.close()
        assert _pages_at(receiver.address, ns, keys) == b"".join(pages)
        assert holder.core.quarantined() == [] and receiver.core.quarantined() == []
        assert len(receiver.core.reads.unchecked) == 0
    finally:
        relay.close()
        await server.close()


async def test_a_page_scribbled_on_at_the_holder_is_quarantined_there_not_copied(server_factory, tmp_path) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 3)
    flip_arena_byte(holder, holder.core.where(keys[1])["host"] + 100)  # a client that maps the arena scribbles
    server = TcpPageServer(CorePageSource(holder.core))
    port = await server.start()
    try:
        peer = Peer(port)
        tier = RemoteTier(receiver.core, {"holder": peer}, None, "tcp")  # type: ignore[arg-type]
        assert await tier.fetch_from("holder", ns, keys, PAGE_BYTES, 10.0, "", hashed=True) == 1
        await peer.fetcher.close()
        assert _found(receiver.address, ns, keys) == 1 and _pages_at(receiver.address, ns, keys) == pages[0]
        assert keys[1] in {q.key for q in holder.core.quarantined()}  # the holder took it out of service
        assert _found(holder.address, ns, keys) == 1
    finally:
        await server.close()
