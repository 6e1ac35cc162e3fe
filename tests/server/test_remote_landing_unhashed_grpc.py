"""On the gRPC data plane a reader's fill and a handoff's push land unhashed too (DESIGN §4): the
holder sends them unhashed (``ReadPagesRequest.unchecked``), the receiver copies them into its
slots unhashed and commits them with the checksum the holder's chunks carry, noting the holder as
their source. A reader that finds one damaged drops it and has the holder check its own copy (a
one-page ``ReadPages`` without the flag: the holder's send checks it and quarantines it). A
replica's or migration's copy (``hashed=True``) is still checked where it is sent and where it
lands. Real servers over loopback, each holder's real gRPC ReadPages."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from support.servers import flip_arena_byte, make_config
from test_remote_landing import PAGE_BYTES, DamagingLink, _found, _store
from test_remote_landing_tcp import _checks_done, _pages_at, _setup
from test_remote_landing_unhashed import _quarantined

from kvstore._proto import data_pb2
from kvstore.page_wire.grpc_chunks import MESSAGE_OPTIONS, PageStubs
from kvstore.server.cluster.remote import RemoteTier


class GrpcPeer:
    """A holder as ``RemoteTier`` calls it on the gRPC plane: its page stubs, no fetcher."""

    fetcher = None

    def __init__(self, channel: grpc.aio.Channel, node_id: str = "holder") -> None:
        self.pages = PageStubs(channel)
        self.member = type("Member", (), {"node_id": node_id})()


class OneHolder:
    """The lookup as ``read_into_landing`` asks it: every page held on ``node``'s host tier."""

    def __init__(self, node: str) -> None:
        self.node = node

    async def records(self, namespace_id: bytes, keys: list[bytes], timeout_s: float, tenant: str) -> list[Any]:
        return [(self.node, "host", PAGE_BYTES)] * len(keys)


class Damaging(DamagingLink):
    """``DamagingLink`` as a gRPC-plane peer (no fetcher). A source check through it asks for one
    page: one message, never the flipped one."""

    fetcher = None


def _tier(receiver: Any, peer: Any) -> RemoteTier:
    return RemoteTier(receiver.core, {"holder": peer}, OneHolder("holder"), "grpc")  # type: ignore[arg-type]


async def test_a_fill_lands_a_holders_scribbled_page_unhashed_never_serves_it_and_its_source_quarantines_it(
        server_factory, tmp_path) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    flip_arena_byte(holder, holder.core.where(keys[2])["host"] + 100)  # a client that maps the holder's arena scribbles
    async with grpc.aio.insecure_channel(holder.address, options=MESSAGE_OPTIONS) as channel:
        tier = _tier(receiver, GrpcPeer(channel))
        assert await tier.read_into_landing(ns, keys, 10.0) == 4  # sent and landed unhashed, committed ...
        assert holder.core.quarantined() == [] and _found(receiver.address, ns, keys) == 4
        assert await asyncio.to_thread(_pages_at, receiver.address, ns, keys) == pages[0] + pages[1]  # ... never served
        assert keys[2] in {q.key for q in receiver.core.quarantined()}
        assert await _quarantined(holder, keys[2]), "the source was not asked to check its copy, or did not drop it"
        assert _found(holder.address, ns, keys) == 2
        assert tier.source_checks.num_asked == 1


async def test_a_page_damaged_on_the_way_is_dropped_where_it_landed_its_source_kept_and_fetched_whole_next(
        server_factory, tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore.server.cluster.source_checks")
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    async with grpc.aio.insecure_channel(holder.address, options=MESSAGE_OPTIONS) as channel:
        damaging = Damaging(channel, bad=1)  # page 2's one message, flipped on its way
        tier = _tier(receiver, damaging)
        assert await tier.fetch_from("holder", ns, keys, PAGE_BYTES, 10.0, "", hashed=False) == 4  # a handoff's push
        assert await asyncio.to_thread(_pages_at, receiver.address, ns, keys) == pages[0]
        await _checks_done(tier)
        assert tier.source_checks.num_asked == 1 and holder.core.quarantined() == []
        assert "holder checked its copy: sound, sent" in caplog.text
        assert keys[1] in {q.key for q in receiver.core.quarantined()} and _found(holder.address, ns, keys) == 4
        tier = _tier(receiver, GrpcPeer(channel))
        assert await tier.read_into_landing(ns, keys, 10.0) == 4
        assert await asyncio.to_thread(_pages_at, receiver.address, ns, keys) == b"".join(pages)


async def test_damage_fetched_on_by_a_third_node_is_dropped_at_every_node_it_passed(server_factory, tmp_path) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    flip_arena_byte(holder, holder.core.where(keys[1])["host"] + 7)
    third = server_factory(make_config(tmp_path / "third"))
    async with grpc.aio.insecure_channel(holder.address, options=MESSAGE_OPTIONS) as to_holder, \
            grpc.aio.insecure_channel(receiver.address, options=MESSAGE_OPTIONS) as to_receiver:
        at_receiver = _tier(receiver, GrpcPeer(to_holder))
        at_third = RemoteTier(third.core, {"receiver": GrpcPeer(to_receiver, "receiver")}, OneHolder("receiver"), "grpc")  # type: ignore[arg-type]
        assert await at_receiver.read_into_landing(ns, keys, 10.0) == 4
        assert await at_third.read_into_landing(ns, keys, 10.0) == 4  # the receiver sends its unhashed copy unhashed
        assert await asyncio.to_thread(_pages_at, third.address, ns, keys) == pages[0]  # never served ...
        for server in (third, receiver, holder):  # ... and dropped where it landed, where it came from, and at its source
            assert await _quarantined(server, keys[1])
    assert [_found(s.address, ns, keys) for s in (holder, receiver, third)] == [1, 1, 1]


async def test_sound_pages_land_unhashed_bit_exact_and_noted_unchecked(server_factory, tmp_path) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 5)
    _store(receiver.address, ns, keys[2:3], pages[2:3])  # stored here already: sent, not landed, not noted
    async with grpc.aio.insecure_channel(holder.address, options=MESSAGE_OPTIONS) as channel:
        assert await _tier(receiver, GrpcPeer(channel)).read_into_landing(ns, keys, 10.0) == 5
    assert len(receiver.core.reads.unchecked) == 4
    assert _pages_at(receiver.address, ns, keys) == b"".join(pages)
    assert receiver.core.quarantined() == [] and holder.core.quarantined() == []


async def test_a_replicas_copy_is_checked_where_it_is_sent(server_factory, tmp_path) -> None:
    """``hashed=True`` (a replica, a migration): the holder's send checks each page, so its
    scribbled page is quarantined there at once and never lands."""
    holder, receiver, ns, keys, _ = await _setup(server_factory, tmp_path, 4)
    flip_arena_byte(holder, holder.core.where(keys[2])["host"] + 100)
    async with grpc.aio.insecure_channel(holder.address, options=MESSAGE_OPTIONS) as channel:
        tier = _tier(receiver, GrpcPeer(channel))
        assert await tier.fetch_from("holder", ns, keys, PAGE_BYTES, 10.0, "", hashed=True) == 2
    assert keys[2] in {q.key for q in holder.core.quarantined()}
    assert _found(receiver.address, ns, keys) == 2 and len(receiver.core.reads.unchecked) == 0


async def test_a_replicas_copy_is_checked_where_it_lands(server_factory, tmp_path) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    async with grpc.aio.insecure_channel(holder.address, options=MESSAGE_OPTIONS) as channel:
        tier = _tier(receiver, Damaging(channel, bad=1))
        assert await tier.fetch_from("holder", ns, keys, PAGE_BYTES, 10.0, "", hashed=True) == 1
    assert _found(receiver.address, ns, keys) == 1 and holder.core.quarantined() == []
    assert _pages_at(receiver.address, ns, keys) == pages[0]


async def test_a_source_check_over_grpc_names_the_namespaces_tenant_here(server_factory, tmp_path) -> None:
    """The source's ReadPages answers a node only for a namespace bound to the tenant it names:
    the check names the one this node binds the namespace to (``tenant_of``), without ``unchecked``."""
    asked: list[data_pb2.ReadPagesRequest] = []

    class Recording:
        fetcher = None
        member = type("Member", (), {"node_id": "holder"})()
        pages = None

        def read_pages(self, request: data_pb2.ReadPagesRequest, timeout: float) -> Any:
            asked.append(request)

            class Nothing:
                def __aiter__(self) -> Any:
                    return self

                async def __anext__(self) -> bytes:
                    raise StopAsyncIteration

                def cancel(self) -> None:
                    pass

            return Nothing()

    peer = Recording()
    peer.pages = peer
    _, receiver, ns, keys, _ = await _setup(server_factory, tmp_path, 1)
    tier = RemoteTier(receiver.core, {"holder": peer}, None, "grpc", tenant_of=lambda n: "acme" if n == ns else None)  # type: ignore[arg-type]
    header = type("Header", (), {"namespace_id": ns, "key": keys[0], "payload_bytes": PAGE_BYTES})()
    await tier.source_checks._check(header, "holder")  # type: ignore[arg-type]
    assert [(r.tenant, r.local_only, r.unchecked, list(r.keys)) for r in asked] == [("acme", True, False, keys[:1])]
