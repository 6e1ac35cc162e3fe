"""A copy landed here unhashed (a reader's fill, a handoff's push) is not a checked copy: a
replica or a migration asked of this node afterwards (``fetch_from(hashed=True)``: a copy that may
become the only one, DESIGN §4) must not count it as held without checking it. Real servers over
loopback, the holder's real gRPC ReadPages."""

from __future__ import annotations

import asyncio

import grpc
from test_remote_landing import PAGE_BYTES
from test_remote_landing_tcp import _pages_at, _setup
from test_remote_landing_unhashed_grpc import Damaging, GrpcPeer, _tier

from kvstore.page_wire.grpc_chunks import MESSAGE_OPTIONS


async def test_a_replica_over_a_copy_landed_unhashed_is_checked(server_factory, tmp_path) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    async with grpc.aio.insecure_channel(holder.address, options=MESSAGE_OPTIONS) as channel:
        # a handoff's push: page 2 damaged on its way, landed unhashed, no reader has consumed it yet
        assert await _tier(receiver, Damaging(channel, bad=1)).fetch_from("holder", ns, keys, PAGE_BYTES, 10.0, "",
                                                                          hashed=False) == 4
        # then the holder asks this node for a replica (or a migration copies here): hashed, checked as it lands
        held = await _tier(receiver, GrpcPeer(channel)).fetch_from("holder", ns, keys, PAGE_BYTES, 10.0, "", hashed=True)
    # every page the replica counts is one whose bytes hold: the holder may drop its own copy next
    assert await asyncio.to_thread(_pages_at, receiver.address, ns, keys[:held]) == b"".join(pages[:held])
    assert held == 4, "a sound copy was to be fetched again, checked"


async def test_a_grpc_fetch_keeps_the_source_note_of_a_page_it_finds_stored_here_already(server_factory, tmp_path) -> None:
    """A page landed here unhashed, then met as stored already by a later gRPC fetch (a fill whose
    run starts before it): that fetch lands nothing of it, so its note (the node to ask when a
    reader finds it damaged) stays, as on the UCX and TCP planes (``_land_posted`` commits only
    the pages it landed)."""
    holder, receiver, ns, keys, _ = await _setup(server_factory, tmp_path, 2)
    async with grpc.aio.insecure_channel(holder.address, options=MESSAGE_OPTIONS) as channel:
        tier = _tier(receiver, GrpcPeer(channel))
        assert await tier.fetch_from("holder", ns, keys[1:], PAGE_BYTES, 10.0, "", hashed=False) == 1
        assert len(receiver.core.reads.unchecked) == 1
        assert await tier.read_into_landing(ns, keys, 10.0) == 2  # page 1 lands, page 2 is stored here already
    assert len(receiver.core.reads.unchecked) == 2, "the page stored here already lost the note of its source"
    assert tier.num_fetched == 2  # the two pages that landed, not the one met stored
