"""Invalidations across restarts (DESIGN §12.4): a node restarted on its data serves
nothing until it has caught up with the generations etcd holds, so pages invalidated while it
was down are never served, even while it cannot reach etcd."""

from __future__ import annotations

import asyncio
import time

from invalidation_cases import invalidate, read_checked, served, tokens_owned_by
from support.cluster_nodes import Node, cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from support.tcp_proxy import TcpProxy
from test_cluster_nodes import LAYOUT, NS, ctl_cluster

from kvstore.client import KVStoreClient


async def test_a_node_restarted_on_its_data_serves_nothing_invalidated_while_it_was_down(cluster_nodes, etcd,
                                                                                          tmp_path) -> None:
    """Defect 3: b stores a durable prefix and stops; the namespace is invalidated at a; b
    restarts with its etcd link cut. Before, b's gRPC server answered from its recovered SSD
    pages while it waited to join (3 TTLs). Now it serves nothing until it is a member that
    has caught up with etcd's generations, and then the pages are gone."""
    (a,) = cluster_nodes(["a"], "grpc")
    etcd_link = TcpProxy(("127.0.0.1", etcd.client_port))
    b = Node(tmp_path, "b", f"etcd://127.0.0.1:{etcd_link.port}", "grpc")
    try:
        b.start()
        tokens = tokens_owned_by(["a", "b"], {"a", "b"}, 4)
        kv = random_kv(LAYOUT, len(tokens), seed=4)
        async with KVStoreClient(b.address, NS) as on_b:
            assert await on_b.put(tokens, kv, durable=True) == len(tokens)
        b.stop()
        await invalidate(a.address, NS.namespace_id)
        etcd_link.cut()
        b.launch()  # on its data (the durable prefix is on its SSD); it cannot reach etcd
        deadline, reads, stale = time.monotonic() + 6.0, 0, 0
        while time.monotonic() < deadline:
            try:
                stale += await read_checked(b.address, tokens, kv, "b cut off from etcd") > 0
                reads += 1
            except Exception:  # noqa: BLE001 - not listening yet, or not answering: no read
                await asyncio.sleep(0.1)
        assert reads > 0, "b never answered while cut off"
        assert stale == 0, f"b served invalidated pages {stale} times in {reads} reads while cut off from etcd"
        etcd_link.restore()
        b.wait_ready()
        assert await served(b.address, tokens) == 0, "b served invalidated pages after it joined"
    finally:
        etcd_link.restore()
        b.stop()
        etcd_link.close()


async def test_an_invalidation_after_etcd_was_replaced_reaches_every_node(cluster_nodes, etcd) -> None:
    """Defect 2: each node kept the etcd revision of the last invalidation it applied and
    skipped any at a revision not above it; a replaced etcd (wiped, or restored) numbers its
    revisions anew, so b skipped the next invalidation and served the invalidated pages. Now
    generations are compared, not revisions, and the nodes write the generations they entered
    back into the new etcd: it goes on from there."""
    a, b = cluster_nodes(["a", "b"], "grpc")
    for _ in range(12):  # the old etcd's revisions go well past what the new one will reach
        await invalidate(a.address, NS.namespace_id)
    etcd.wipe()
    tokens = tokens_owned_by(["a", "b"], {"a", "b"}, 4)
    kv = random_kv(LAYOUT, len(tokens), seed=5)
    async with KVStoreClient(a.address, NS) as on_a:
        await eventually(lambda: _stored(on_a, tokens, kv), 20, "a storing again in the new etcd")
    await eventually(lambda: _read_whole(b.address, tokens, kv), 10, "the prefix read at b (b holds a copy)")
    answer = await invalidate(a.address, NS.namespace_id)
    for node in (a, b):
        assert await served(node.address, tokens) == 0, f"{node.name} served invalidated pages"
    assert answer.generation == 13, "the generation went back with etcd"


async def _stored(client: KVStoreClient, tokens: list[int], kv) -> bool:  # type: ignore[no-untyped-def]
    try:
        return await client.put(tokens, kv) == len(tokens)
    except Exception:  # noqa: BLE001 - not a member again yet
        return False


async def _read_whole(address: str, tokens: list[int], kv) -> bool:  # type: ignore[no-untyped-def]
    return await read_checked(address, tokens, kv, "a read") == len(tokens)


async def test_a_node_that_missed_an_invalidation_waits_for_the_others_after_etcd_was_wiped(cluster_nodes, etcd,
                                                                                            tmp_path) -> None:
    """Two faults: x is down while its namespace is invalidated at a, then etcd is wiped (the
    generation gone with it) and x restarts before a could write it back (a's etcd link held).
    Before, x caught up with an etcd that knew nothing and served its invalidated pages. Now a
    node that was registered before waits, in an etcd younger than a TTL, until the nodes etcd
    lists have caught up there too (written back what they knew)."""
    link = TcpProxy(("127.0.0.1", etcd.client_port))
    a = Node(tmp_path, "a", f"etcd://127.0.0.1:{link.port}", "grpc")
    (x,) = cluster_nodes(["x"], "grpc")
    try:
        a.start()
        tokens = tokens_owned_by(["a", "x"], {"a", "x"}, 4)
        kv = random_kv(LAYOUT, len(tokens), seed=6)
        async with KVStoreClient(x.address, NS) as on_x:
            assert await on_x.put(tokens, kv, durable=True) == len(tokens)
        x.stop()
        await invalidate(a.address, NS.namespace_id)  # x is not registered: nothing to wait for
        link.hold()  # a hears of the wipe only once released
        etcd.wipe()
        x.launch()
        await eventually(lambda: _registered(etcd.url, "x"), 20, "x registered in the new etcd")
        await asyncio.sleep(0.3)
        link.release()  # a finds its lease gone, registers again, writes generation 1 back
        x.wait_ready()
        assert await served(x.address, tokens) == 0, "x served pages invalidated while it was down"
    finally:
        link.release()
        a.stop()
        link.close()


async def _registered(etcd_url: str, node: str) -> bool:
    members = await asyncio.to_thread(ctl_cluster, etcd_url)
    return node in {m["node"] for m in members["members"]}
