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
from kvstore.directory.events import EventKind
from kvstore.page_wire.grpc_chunks import PageStubs
from kvstore.server.cluster import publisher as publisher_module
from kvstore.server.cluster.publisher import Publisher, Record
from kvstore.server.cluster.remote import RemoteTier
from kvstore.server.placement.unchecked import UncheckedCopies

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
    core = SimpleNamespace(node="a", directory=Directory(tmp_path, "a"), reads=SimpleNamespace(unchecked=UncheckedCopies()))
    remote = RemoteTier(core, SimpleNamespace(), None, "grpc")  # type: ignore[arg-type]
    assert await remote._fetch_grpc(holder, NS, [bytes(32)], 1.0) == 0  # type: ignore[arg-type]


async def test_a_batch_cut_by_the_owners_leaving_is_not_sent_again_to_its_next_incarnation(tmp_path) -> None:
    """Review of the owner's re-registration (found by a helper): a send to owner b spans
    batches; between two of them b leaves (what was queued for b is dropped), a page goes here
    (nothing queued for b: not an owner then), b registers again (it is sent what is held here,
    not the page). The next batch ends with the old channel, and the rest was queued again
    because b was a member again: the removed page was published to b's new incarnation, after
    its cut, for good. Now the rest is queued again only for the incarnation it was sent to."""
    config = ShardConfig(segment_pages=1, replicas=1)
    with_b, without_b = ShardMap(["a", "b"], config), ShardMap(["a"], config)
    current = {"map": with_b}
    gone, first = b"\x02" * 32, b"\x01" * 32
    publisher: Publisher

    async def publish(request: object, timeout: float) -> None:
        if peers.now is old:  # the first batch: meanwhile b leaves, the page goes, b comes back as epoch 2
            peers.now, current["map"] = None, without_b
            publisher.members_changed(with_b, without_b)
            publisher._apply([(EventKind.REMOVED, NS, gone, "host", 4096, 0)])
            peers.now, current["map"] = new, with_b
            publisher.members_changed(without_b, with_b)
            return
        raise grpc.aio.UsageError("Channel is closed")  # the old channel, closed since

    old = SimpleNamespace(directory=SimpleNamespace(Publish=publish), member=SimpleNamespace(node_id="b", epoch=1))
    new = SimpleNamespace(directory=SimpleNamespace(Publish=publish), member=SimpleNamespace(node_id="b", epoch=2))
    peers = SimpleNamespace(now=old)
    peers.get = lambda node: peers.now if node == "b" else None
    directory = Directory(tmp_path, "a")
    publisher = Publisher(directory, "a", peers, lambda: current["map"], 1.0)  # type: ignore[arg-type]
    try:
        for key in (first, gone):
            publisher._held[(key, "host")] = Record(key, NS, "host", 4096)
        change = {(k, "host"): (publisher._held[(k, "host")], True) for k in (first, gone)}
        with_batches_of_one = publisher_module.BATCH_RECORDS
        publisher_module.BATCH_RECORDS = 1
        try:
            await publisher._send("b", change)
        finally:
            publisher_module.BATCH_RECORDS = with_batches_of_one
        queued = publisher._pending.get("b", {}).get((gone, "host"))
        assert queued is None or queued[1] is False, "a page removed here was queued to be published to b's new incarnation"
    finally:
        directory.close()
