"""A node that loses its etcd lease stops acting as a member until it registers again (DESIGN
§12: it would be split-brained). Node b reaches etcd through a proxy the test cuts: etcd
expires b's lease and the others drop b, while b itself keeps running."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.cluster_nodes import TTL_S, Node, cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from support.tcp_proxy import TcpProxy
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore._proto import directory_pb2
from kvstore.client import KVStoreClient
from kvstore.cluster.shards import ShardConfig, ShardMap
from kvstore.errors import TierUnavailable

SHARDS = ShardMap(["a", "b", "c"], ShardConfig(segment_pages=1, replicas=1))  # the nodes' own map (per-page owners)


async def test_a_node_that_lost_its_lease_stops_acting_as_a_member(cluster_nodes, etcd, tmp_path) -> None:
    """Bug: b, cut off from etcd past its TTL (the others dropped it), still answered lookups
    with the records it kept as a shard owner and those the others gave it, and kept
    publishing its new pages to the others, which listed them again for a node that is not a
    member. Then (DESIGN §12.4): it still served its own pages, which an invalidation acknowledged
    without it (it is not listed in etcd any more) may have killed. Now b serves and stores
    nothing until it registers again (epoch 2) and caught up with etcd's generations; then it
    republishes and everything is found again.

    Bug (found by the chaos model, seed 70099): a page a removed while b was out of the
    cluster stayed promised for ever by b's record of it, which b kept as its shard owner
    through the partition (a's withdrawal, queued for an owner that had left, was dropped).
    Now a node that registers again forgets the records the others gave it before, and
    they publish again what they hold."""
    a, c = cluster_nodes(["a", "c"], "grpc")
    proxy = TcpProxy(("127.0.0.1", etcd.client_port))
    b = Node(tmp_path, "b", f"etcd://127.0.0.1:{proxy.port}", "grpc")
    try:
        b.start()
        await _partitioned_node_case(a, b, c, proxy)
    finally:
        b.stop()
        proxy.close()


async def _partitioned_node_case(a: Node, b: Node, c: Node, proxy: TcpProxy) -> None:
    on_a, on_b, on_c = (KVStoreClient(n.address, NS) for n in (a, b, c))
    async with on_a, on_b, on_c:
        # a's prefix, some of whose records b keeps as their owner
        tokens_a = tokens_of(11, 16)
        kv_a = random_kv(LAYOUT, len(tokens_a), seed=11)
        keys_a = on_a.keys(tokens_a)
        assert any(SHARDS.owners(k) == ("b",) for k in keys_a), "precondition: b owns records of a's prefix"
        assert await on_a.put(tokens_a, kv_a) == len(tokens_a)
        await eventually(lambda: _found(on_b, tokens_a, len(tokens_a)), 10, "a's prefix in b's lookup")
        # b's own page, to see when the others dropped b
        mark = tokens_of(12, 1)
        assert await on_b.put(mark, random_kv(LAYOUT, len(mark), seed=12)) == len(mark)
        await eventually(lambda: _found(on_c, mark, len(mark)), 10, "b's page in c's lookup")
        # a page of a's whose record b owns, removed by a while b is out (below)
        gone = tokens_of(next(s for s in range(100, 400) if SHARDS.owners(on_a.keys(tokens_of(s, 1))[0]) == ("b",)), 1)
        assert await on_a.put(gone, random_kv(LAYOUT, len(gone), seed=13)) == len(gone)
        await eventually(lambda: _found(on_c, gone, len(gone)), 10, "a's page in c's lookup, by b's record")

        proxy.cut()
        await eventually(lambda: _found(on_c, mark, 0), 3 * TTL_S + 2, "b dropped by c once etcd expired its lease")
        # b still runs, but answers nothing: neither its own pages nor records of the others
        assert (await on_b.lookup(mark)).num_tokens == 0, "b served its own pages while not a member"
        assert (await on_b.lookup(tokens_a)).num_tokens == 0, "b answered with records of a node it is cut off from"
        owned = [k for k in keys_a if SHARDS.owners(k) == ("b",)]
        asked = directory_pb2.LookupRequest(namespace_id=on_b.namespace.namespace_id, keys=owned[:1], local_only=True)
        assert (await on_b._call(on_b.runtime.directory.Lookup, asked)).num_pages == 0, "b answered as a shard owner"
        # b stores nothing while it is not a member (a page stored now could be of a generation the cluster left)
        # a prefix whose first record b would publish to another node (one it owns itself would show nothing)
        seed = next(s for s in range(13, 100) if SHARDS.owners(on_b.keys(tokens_of(s, 8))[0]) != ("b",))
        tokens_b = tokens_of(seed, 8)
        kv_b = random_kv(LAYOUT, len(tokens_b), seed=seed)
        with pytest.raises(TierUnavailable, match="not a member"):
            await on_b.put(tokens_b, kv_b)
        await asyncio.sleep(1.0)  # 50 publish periods: nothing may arrive (there is no event for "nothing")
        assert (await on_c.lookup(tokens_b)).num_tokens == 0, "b published records while not a member"

        removed = await on_a._call(on_a.runtime.directory.Remove, directory_pb2.RemoveRequest(
            namespace_id=on_a.namespace.namespace_id, keys=on_a.keys(gone)))
        assert removed.num_removed == 1

        proxy.restore()  # b registers again (epoch 2), catches up and republishes everything
        await eventually(lambda: _found(on_c, mark, len(mark)), 15, "b's page published again after it registered again")
        await eventually(lambda: _stored(on_b, tokens_b, kv_b), 10, "b storing again once it rejoined")
        await eventually(lambda: _found(on_c, tokens_b, len(tokens_b)), 10, "b's new pages published")
        # b serves again: its record of the page a removed meanwhile must be gone
        assert (await on_c.lookup(gone)).num_tokens == 0, "c's lookup promised a page a removed while b was out"
        assert (await on_a.lookup(gone)).num_tokens == 0, "a's lookup promised a page it removed while b was out"
        await eventually(lambda: _found(on_b, tokens_a, len(tokens_a)), 10, "a's prefix in b's lookup again")
        out = torch.zeros_like(kv_b)
        assert await on_c.get(await on_c.lookup(tokens_b), out) == len(tokens_b)
        assert torch.equal(out, kv_b)


async def _found(client: KVStoreClient, tokens: list[int], num_tokens: int) -> bool:
    return (await client.lookup(tokens)).num_tokens == num_tokens


async def _stored(client: KVStoreClient, tokens: list[int], kv: torch.Tensor) -> bool:
    try:
        return await client.put(tokens, kv) == len(tokens)
    except TierUnavailable:  # registered, not caught up yet
        return False
