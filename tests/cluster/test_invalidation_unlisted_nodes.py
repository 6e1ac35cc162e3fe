"""What an invalidation waits for at a node that never listed some node still serving (DESIGN
§12.4). Such a node is one of a replaced etcd, one fenced before this node's view began, or one
whose lease expired before it. Before, a node waited a TTL of its own from its start for all of
them alike: its first invalidation within a TTL of its start waited that long even on an etcd
months old, and a fenced node of a longer TTL served on past it. Now the fenced node's record
in etcd, the age of etcd's incarnation (by etcd's clock) and the view's last snapshot bound it."""

from __future__ import annotations

import asyncio
import time

from invalidation_cases import cut_off_later, invalidate, read_checked
from support.cluster_nodes import cluster_nodes_fixture  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_nodes import LAYOUT, NS
from test_invalidation_fencing import OTHER

from kvstore.client import KVStoreClient
from kvstore.cluster.etcd import EtcdClient, parse_endpoints
from kvstore.cluster.generation_records import EtcdGenerations

ROOT = b"/kvstore/default/"
TOKENS = list(range(4 * LAYOUT.page_tokens))


async def _put_at(address: str) -> object:
    kv = random_kv(LAYOUT, len(TOKENS), seed=11)
    async with KVStoreClient(address, NS) as client:
        assert await client.put(TOKENS, kv) == len(TOKENS)
    assert await read_checked(address, TOKENS, kv, "before") == len(TOKENS)
    return kv


async def _gone_from_etcd(client: EtcdClient, node: str) -> None:
    while any(kv.key == ROOT + b"nodes/" + node.encode() for kv in (await client.get_prefix(ROOT + b"nodes/"))[1]):
        await asyncio.sleep(0.01)


async def test_a_node_started_on_an_old_etcd_answers_its_first_invalidation_without_waiting_a_ttl(cluster_nodes, etcd) -> None:
    """etcd's incarnation was made (etcd last started) more than a TTL ago, by etcd's clock: no node
    of an etcd it replaced can still serve. The invalidation is confirmed at once; before, it
    waited out 6.8 s from b's start and a 4 s deadline answered UNAVAILABLE."""
    client = EtcdClient(parse_endpoints(etcd.url))
    try:
        records = EtcdGenerations(client, ROOT, "t")
        while (await records.incarnation())[1] < 7.0:  # past 6 s x 1.05 + 0.5 s
            await asyncio.sleep(0.5)
    finally:
        await client.close()
    _a, b = cluster_nodes(["a", "b"], "grpc", "--cluster-ttl", "6")
    answer = await invalidate(b.address, NS.namespace_id, timeout_s=4)
    assert answer.generation == 1


async def test_a_node_of_a_replaced_etcd_is_waited_for_by_a_node_that_never_listed_it(cluster_nodes, etcd, tmp_path) -> None:
    """x registered in an etcd that was wiped; cut off from the new one, it serves until its
    lease's TTL is out. c starts on the new etcd and never lists x: its invalidation is
    confirmed only once x can no longer serve (the new incarnation is younger than a TTL)."""
    with cut_off_later(tmp_path, etcd.client_port, "x", "grpc", "--cluster-ttl", "6") as (x, cut):
        kv = await _put_at(x.address)
        cut()
        etcd.wipe()
        (c,) = cluster_nodes(["c"], "grpc", "--cluster-ttl", "6")
        await invalidate(c.address, NS.namespace_id)
        assert await read_checked(x.address, TOKENS, kv, "after c's OK") == 0, \
            "x, of the replaced etcd, served an invalidated generation after Invalidate returned OK at c"


async def test_a_node_fenced_before_another_node_started_is_waited_for_by_it(cluster_nodes, etcd, tmp_path) -> None:
    """a's invalidation fences x (x's TTL 10 s), cut off from etcd and its peers. c starts
    after x's key is gone (TTL 2 s: its own wait from its start was 2.6 s) and invalidates
    another namespace: confirmed only once x can no longer serve, by the record of the fencing."""
    (a,) = cluster_nodes(["a"], "grpc")
    client = EtcdClient(parse_endpoints(etcd.url))
    try:
        with cut_off_later(tmp_path, etcd.client_port, "x", "grpc", "--cluster-ttl", "10") as (x, cut):
            kv = await _put_at(x.address)
            cut()
            first = asyncio.create_task(invalidate(a.address, OTHER.namespace_id))
            await asyncio.wait_for(_gone_from_etcd(client, "x"), 30)
            (c,) = cluster_nodes(["c"], "grpc")
            started = time.monotonic()
            await invalidate(c.address, NS.namespace_id)
            n = await read_checked(x.address, TOKENS, kv, "after c's OK")
            await first
            assert n == 0, f"x served {n} tokens of an invalidated generation after Invalidate returned OK at c " \
                           f"({time.monotonic() - started:.1f} s after c's start)"
    finally:
        await client.close()
