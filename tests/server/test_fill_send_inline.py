"""A node's fill over gRPC (``ReadPagesRequest.unchecked``: its pages sent unhashed, DESIGN §4) is
built on the thread that sends it, not one page ahead on the holder's read-ahead workers: with
nothing to hash, the build is one copy of the slot into its message, and handing each page to a
worker and back cost the holder more CPU than the overlap saved (kvstore/server/services/README.md).
A client's ReadPages, checked as it is sent, still builds one page ahead. The first test was seen
failing before (the fill's pages were built on the read-ahead workers)."""

from __future__ import annotations

import threading

import grpc
from test_remote_landing import PAGE_BYTES
from test_remote_landing_tcp import _pages_at, _setup
from test_remote_landing_unhashed_grpc import GrpcPeer, _tier

from kvstore._proto import data_pb2
from kvstore.page_wire.grpc_chunks import MESSAGE_OPTIONS, PageStubs, decode_chunk


def _read_ahead_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("read-ahead")}


async def test_a_fill_is_built_where_it_is_sent_bit_exact(server_factory, tmp_path) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 6)
    before = _read_ahead_threads()
    async with grpc.aio.insecure_channel(holder.address, options=MESSAGE_OPTIONS) as channel:
        assert await _tier(receiver, GrpcPeer(channel)).read_into_landing(ns, keys, 10.0) == 6
    assert _read_ahead_threads() - before == set(), "the fill's pages were built on the read-ahead workers"
    assert _pages_at(receiver.address, ns, keys) == b"".join(pages)
    assert len(receiver.core.reads.unchecked) == 6 and holder.core.quarantined() == []


async def test_a_clients_checked_read_still_builds_ahead(server_factory, tmp_path) -> None:
    holder, _, ns, keys, pages = await _setup(server_factory, tmp_path, 3)
    with grpc.insecure_channel(holder.address, options=MESSAGE_OPTIONS) as channel:
        raw = list(PageStubs(channel).read_pages(data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys)))
    assert b"".join(bytes(decode_chunk(r).data) for r in raw) == b"".join(pages)
    assert all(len(decode_chunk(r).data) == PAGE_BYTES for r in raw)
    assert _read_ahead_threads(), "a client's checked ReadPages ran on the read-ahead workers"
