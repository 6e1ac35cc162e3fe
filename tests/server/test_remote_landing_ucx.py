"""A node fetching pages over the UCX data plane into its landing slots: a page scribbled on
in the holder's arena is quarantined at the holder, never sent, and the pages before it are
committed (verified before served, as over gRPC and TCP: DESIGN §11). Real servers, a real
UCX page server on the holder's core, UCX over loopback TCP (as tests/cluster's UCX tests)."""

from __future__ import annotations

from support.servers import flip_arena_byte
from test_remote_landing import PAGE_BYTES, _found
from test_remote_landing_tcp import _pages_at, _setup

from kvstore.cluster.page_fetch import FetchStatus
from kvstore.cluster.transport_ucx import UcxConfig, UcxPageFetcher, UcxPageServer
from kvstore.server.cluster.remote import RemoteTier
from kvstore.server.cluster.source import CorePageSource

UCX = UcxConfig(tls="tcp", progress_mode="blocking")  # tests/cluster's: UCX reads its config once per process


class Peer:
    """The holder as ``RemoteTier`` calls it on the UCX plane: only its fetcher."""

    def __init__(self, port: int) -> None:
        self.fetcher = UcxPageFetcher("127.0.0.1", port, UCX)
        self.member = type("Member", (), {"node_id": "holder"})()


async def test_a_page_scribbled_on_at_the_holder_is_quarantined_not_sent_over_ucx(server_factory, tmp_path) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 4)
    flip_arena_byte(holder, holder.core.where(keys[2])["host"] + 100)  # a client that maps the arena scribbles
    server = UcxPageServer(CorePageSource(holder.core), UCX)
    port = await server.start()
    try:
        tier = RemoteTier(receiver.core, None, None, "ucx")  # type: ignore[arg-type]  # no cluster: the peer is given
        peer = Peer(port)
        got = await tier._fetch_posted(peer, ns, keys, PAGE_BYTES, 10.0)  # type: ignore[arg-type]
        assert got == 2 and _found(receiver.address, ns, keys) == 2  # the pages before it are served
        assert _pages_at(receiver.address, ns, keys) == pages[0] + pages[1]
        assert keys[2] in {q.key for q in holder.core.quarantined()}  # the holder took it out of service
        assert _found(holder.address, ns, keys) == 2
        # the next fetch (on a fresh connection) is answered cleanly, not failed again: the holder
        # serves its prefix, which now ends before the quarantined page
        dests = [bytearray(PAGE_BYTES) for _ in keys]
        result = await peer.fetcher.fetch(ns, keys, dests, 10.0)
        await peer.fetcher.close()
        assert result.error is None
        assert result.statuses == [FetchStatus.OK, FetchStatus.OK, FetchStatus.MISSING, FetchStatus.MISSING]
        assert b"".join(dests[:2]) == pages[0] + pages[1]
    finally:
        await server.close()
