"""A node that registers again republishes at once; a shard owner whose etcd watch lags sees
that republish before it sees the new registration, and must keep it when it then drops the
node's old records (DESIGN §12: a record lost there is a miss for as long as the page lives)."""

from __future__ import annotations

import asyncio

import pytest
from cluster_nodes import Node, cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from conftest import random_kv
from etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from tcp_proxy import TcpProxy
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore._proto import common_pb2, directory_pb2
from kvstore.client import KVStoreClient
from kvstore.cluster.shards import ShardConfig, ShardMap
from kvstore.errors import KVStoreError

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
        async with KVStoreClient(o.address, NS) as on_o:
            for tokens in PREFIXES:
                await eventually(lambda t=tokens: _found(on_o, t), 10, "a's prefix in o's lookup")

            proxy.hold()  # o's watch lags from here
            a.stop()  # its lease revoked: o will drop its records when it hears of it
            a.start()  # epoch 2: its SSD pages are republished to their owners, o among them
            await asyncio.sleep(0.5)  # 25 publish periods: the republish has reached o
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
            with pytest.raises(KVStoreError, match="epoch 1 is over"):
                await on_o._call(on_o.runtime.directory.Publish, late)
            lookup = directory_pb2.LookupRequest(namespace_id=on_o.namespace.namespace_id, keys=[late_key], local_only=True)
            assert (await on_o._call(on_o.runtime.directory.Lookup, lookup)).num_pages == 0
    finally:
        proxy.release()
        o.stop()
        proxy.close()


async def _found(client: KVStoreClient, tokens: list[int]) -> bool:
    return (await client.lookup(tokens)).num_tokens == len(tokens)
