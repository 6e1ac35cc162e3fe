"""``UncheckedCopies`` remembers, per key, the node a copy was landed from unhashed; a copy stored
here any other way since (here: a client's own put, verified on arrival) is no longer that
node's, so a reader that finds it damaged must not have that node asked to check "its source".
Real servers, a real TCP page server on the holder's core, over loopback."""

from __future__ import annotations

import asyncio

import grpc
from support.servers import flip_arena_byte
from test_remote_landing import PAGE_BYTES, _found, _store
from test_remote_landing_tcp import Peer, _pages_at, _setup

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.cluster.transport_tcp import TcpPageServer
from kvstore.server.cluster.remote import RemoteTier
from kvstore.server.cluster.source import CorePageSource


async def test_a_copy_that_did_not_come_from_a_node_is_not_checked_there(server_factory, tmp_path) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 1)
    server = TcpPageServer(CorePageSource(holder.core))
    port = await server.start()
    try:
        peer = Peer(port)
        tier = RemoteTier(receiver.core, {"holder": peer}, None, "tcp")  # type: ignore[arg-type]
        assert await tier._fetch_posted(peer, ns, keys, PAGE_BYTES, 10.0) == 1  # type: ignore[arg-type]
        # the landed copy leaves the receiver ...
        with grpc.insecure_channel(receiver.address) as channel:
            directory_pb2_grpc.DirectoryStub(channel).Remove(directory_pb2.RemoveRequest(namespace_id=ns, keys=keys, tier="host"))
        assert _found(receiver.address, ns, keys) == 0
        # ... and a client of the receiver stores the page there itself (verified as it arrives over gRPC)
        _store(receiver.address, ns, keys, pages)
        assert _found(receiver.address, ns, keys) == 1
        flip_arena_byte(receiver, receiver.core.where(keys[0])["host"] + 9)  # then scribbled on, at the receiver only
        assert await asyncio.to_thread(_pages_at, receiver.address, ns, keys) == b""
        assert keys[0] in {q.key for q in receiver.core.quarantined()}
        await asyncio.sleep(0.5)
        # this copy never came from the holder: nothing should be asked of it
        assert tier.source_checks.num_asked == 0, (
            "the holder was asked to check a copy that did not come from it (UncheckedCopies kept the "
            "source of a copy that had left)")
        await peer.fetcher.close()
    finally:
        await server.close()
