"""A peer's channel closed before a Publish or a fetch starts (it left, or registered anew, between the
peer lookup and the call): gRPC raises UsageError there, not CancelledError as when the channel
closes under a call in flight. Both are the owner's departure: the records are queued again
while it is a member, never dropped with an ERROR and a traceback (seen in the chaos run of
2026-12-04: 'publishing records of node ... failed', grpc UsageError 'Channel is closed')."""

from __future__ import annotations

from types import SimpleNamespace

import grpc

from kvstore._proto import directory_pb2_grpc
from kvstore.cluster.shards import ShardConfig, ShardMap
from kvstore.directory import Directory
from kvstore.page_wire.grpc_chunks import PageStubs
from kvstore.server.cluster.publisher import Publisher, Record
from kvstore.server.cluster.remote import RemoteTier

NS = bytes(range(16))


async def test_a_publish_on_a_closed_channel_is_queued_again(tmp_path) -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    await channel.close()
    owner = SimpleNamespace(directory=directory_pb2_grpc.DirectoryStub(channel), member=SimpleNamespace(node_id="c", epoch=1))
    peers = SimpleNamespace(get=lambda node: owner if node == "c" else None)
    shards = ShardMap(["a", "c"], ShardConfig(segment_pages=1, replicas=1))
    publisher = Publisher(Directory(tmp_path, "a"), "a", peers, lambda: shards, 1.0)  # type: ignore[arg-type]
    key = bytes(32)
    change = {(key, "host"): (Record(key, NS, "host", 4096), True)}
    await publisher._send("c", change)  # raised UsageError before
    assert publisher._pending["c"] == change


async def test_a_fetch_on_a_closed_channel_gets_nothing(tmp_path) -> None:
    """The same race on the read side: a ReadPages fetch from a holder whose channel closed
    before the call fetches nothing (the reader's prefix ends there), instead of raising
    UsageError up to the reader's RPC (INTERNAL)."""
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    await channel.close()
    holder = SimpleNamespace(pages=PageStubs(channel), member=SimpleNamespace(node_id="c"))
    core = SimpleNamespace(node="a", directory=Directory(tmp_path, "a"))
    remote = RemoteTier(core, SimpleNamespace(), None, "grpc")  # type: ignore[arg-type]
    assert await remote._fetch_grpc(holder, NS, [bytes(32)], 1.0) == 0  # type: ignore[arg-type]
