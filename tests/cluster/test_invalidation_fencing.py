"""Fencing seen by every issuer (DESIGN §12.4, found by a review of 462107e): x is cut off from
etcd and from its peers, but still within its lease's TTL. An invalidation at a pushes to x,
fails, fences x (revokes its lease) and waits x's TTL out. An invalidation of another
namespace at b meanwhile did not list x (its key went with the revoke), waited for nothing and
answered OK at once, while x still served that namespace's invalidated pages. Now an issuer
also waits out the TTL of every node that left etcd within a TTL (or that its view lists and
etcd does not)."""
from __future__ import annotations

import asyncio
from dataclasses import replace

from invalidation_cases import cut_off_later, invalidate, read_checked
from support.cluster_nodes import cluster_nodes_fixture  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_nodes import LAYOUT, NS

from kvstore.client import KVStoreClient
from kvstore.cluster.etcd import EtcdClient, parse_endpoints

OTHER = replace(NS, revision="r2")  # another namespace, invalidated first


async def test_a_second_issuer_waits_for_a_node_another_issuer_fenced(cluster_nodes, etcd, tmp_path) -> None:
    a, b = cluster_nodes(["a", "b"], "grpc")
    client = EtcdClient(parse_endpoints(etcd.url))
    try:
        with cut_off_later(tmp_path, etcd.client_port, "x", "grpc") as (x, cut):
            tokens = list(range(4 * LAYOUT.page_tokens))
            kv = random_kv(LAYOUT, len(tokens), seed=7)
            async with KVStoreClient(x.address, NS) as on_x:
                assert await on_x.put(tokens, kv) == len(tokens)
            await asyncio.sleep(0.5)
            assert await read_checked(x.address, tokens, kv, "before") == len(tokens)
            cut()
            first = asyncio.create_task(invalidate(a.address, OTHER.namespace_id))
            while True:  # until a revoked x's lease (x's key is gone from etcd)
                _, kvs = await client.get_prefix(b"/kvstore/")
                if not any(kv_.key.endswith(b"nodes/x") for kv_ in kvs):
                    break
                await asyncio.sleep(0.01)
            await invalidate(b.address, NS.namespace_id)
            n = await read_checked(x.address, tokens, kv, "after b's OK")
            await first
            assert n == 0, f"x served {n} tokens of an invalidated generation after Invalidate returned OK at b"
    finally:
        await client.close()
