"""A node that registers again republishes at once; a shard owner whose etcd watch lags sees
that republish before it sees the new registration, and must keep it when it then drops the
node's old records (DESIGN §12: a record lost there is a miss for as long as the page lives)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from support.cluster_nodes import Node, cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from support.tcp_proxy import TcpProxy
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore._proto import common_pb2, directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.cluster.shards import ShardConfig, ShardMap

SHARDS = ShardMap(["a", "o"], ShardConfig(segment_pages=1, replicas=1))  # the nodes' own map (per-page owners)
TTL = "10"  # o's lease outlives the hold (its keep-alive answers wait too)
PREFIXES = [tokens_of(700 + i, 4) for i in range(6)]


async def test_a_republish_that_arrives_before_the_owner_sees_the_new_registration_is_kept(cluster_nodes, etcd,
                                                                                          tmp_path) -> None:
    """Bug (the churn test, CI of stop 32: "prefix of n4 from n2 not within 9 s"): a restarted
    node's republish reached an owner whose watch had not yet delivered the restart; the owner
    then dropped every record of the node published up to that moment, the fresh ones too,
    and nothing sent them again: the node's durable pages were never found through that owner."""
    (a,) = cluster_nodes(["a"], "grpc", "--cluster-ttl", TTL)
    proxy = TcpProxy(("127.0.0.1", etcd.client_port))
    o = Node(tmp_path, "o", f"etcd://127.0.0.1:{proxy.port}", "grpc", "--cluster-ttl", TTL)
    try:
        o.start()
        async with KVStoreClient(a.address, NS) as on_a:
            keys = [k for tokens in PREFIXES for k in on_a.keys(tokens)]
            assert any(SHARDS.owners(k) == ("o",) for k in keys), "precondition: o owns records of a's pages"
            for i, tokens in enumerate(PREFIXES):
                assert await on_a.put(tokens, random_kv(LAYOUT, len(tokens), seed=i), durable=True) == len(tokens)
        owned = sum(1 for k in keys if SHARDS.owners(k) == ("o",))
        async with KVStoreClient(o.address, NS) as on_o, grpc.aio.insecure_channel(o.address) as channel:
            directory = directory_pb2_grpc.DirectoryStub(channel)  # o's raw Directory (loopback, no auth)
            for tokens in PREFIXES:
                await eventually(lambda t=tokens: _found(on_o, t), 10, "a's prefix in o's lookup")

            before = await _settled_seq(directory)
            proxy.hold()  # o's watch lags from here
            a.stop()  # its lease revoked: o will drop its records when it hears of it
            a.start()  # epoch 2: its SSD pages are republished to their owners, o among them
            # each republished record is a STORED event at o: the republish has reached o, before the watch
            await eventually(lambda: _at_least(directory, before + owned), 10, "a's republish at o")
            proxy.release()  # o now hears that a left and registered again
            for tokens in PREFIXES:
                await eventually(lambda t=tokens: _found(on_o, t), 5, "a's republished prefix in o's lookup")
            await asyncio.sleep(1.0)  # the drop runs in a worker: still found after it
            for tokens in PREFIXES:
                assert await _found(on_o, tokens), "o dropped the records a republished"
            # a late call of a's first incarnation is refused, and lists nothing
            late_key = on_o.keys(tokens_of(799, 1))[0]
            late = directory_pb2.PublishRequest(namespace_id=on_o.namespace.namespace_id, epoch=1, records=[
                directory_pb2.PageRecord(key=late_key, location=common_pb2.Location(node="a", tier="host", size_bytes=4096))])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await directory.Publish(late, timeout=5)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "epoch 1 is over" in refused.value.details()
            lookup = directory_pb2.LookupRequest(namespace_id=on_o.namespace.namespace_id, keys=[late_key], local_only=True)
            assert (await directory.Lookup(lookup, timeout=5)).num_pages == 0
    finally:
        proxy.release()
        o.stop()
        proxy.close()


async def _last_seq(directory: directory_pb2_grpc.DirectoryStub) -> int:
    return (await directory.Stats(directory_pb2.StatsRequest(), timeout=5)).last_seq


async def _settled_seq(directory: directory_pb2_grpc.DirectoryStub) -> int:
    """o's last event once a's first publishes stopped coming (bounded)."""
    seq = await _last_seq(directory)
    for _ in range(50):
        await asyncio.sleep(0.2)
        if (now := await _last_seq(directory)) == seq:
            return seq
        seq = now
    raise AssertionError("o's events never settled")


async def _at_least(directory: directory_pb2_grpc.DirectoryStub, seq: int) -> bool:
    return await _last_seq(directory) >= seq


async def _found(client: KVStoreClient, tokens: list[int]) -> bool:
    return (await client.lookup(tokens)).num_tokens == len(tokens)
