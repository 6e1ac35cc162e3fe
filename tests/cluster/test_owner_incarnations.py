"""Records reach their owners again whatever incarnations the owners and holders go through
(DESIGN §12.4): an owner that restarted while a holder's watch was broken, and a
holder registered anew after etcd was replaced, are not left with records nobody sends."""

from __future__ import annotations

import asyncio

from invalidation_cases import tokens_owned_by
from support.cluster_nodes import Node, cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from support.tcp_proxy import TcpProxy
from test_cluster_nodes import LAYOUT, NS, ctl_cluster

from kvstore.client import KVStoreClient

TTL = ("--cluster-ttl", "10")  # the cut or held node's lease outlives what the test does meanwhile


async def test_an_owner_restarted_while_a_holders_watch_was_broken_gets_the_records_again(cluster_nodes, etcd,
                                                                                          tmp_path) -> None:
    """Defect 7: o, the owner of every record of h's prefix, restarted (a new epoch, nothing
    kept) while h's etcd link was cut. h's watch healed from a snapshot that lists o under the
    same name: the shard map had not moved, so h republished nothing and the prefix was a miss
    through o for as long as it lived. Now a node registered anew is sent every record it owns."""
    o, c = cluster_nodes(["o", "c"], "grpc", *TTL)
    link = TcpProxy(("127.0.0.1", etcd.client_port))
    h = Node(tmp_path, "h", f"etcd://127.0.0.1:{link.port}", "grpc", *TTL)
    try:
        h.start()
        tokens = tokens_owned_by(["c", "h", "o"], {"o"}, 4)
        kv = random_kv(LAYOUT, len(tokens), seed=7)
        async with KVStoreClient(h.address, NS) as on_h, KVStoreClient(c.address, NS) as on_c:
            assert await on_h.put(tokens, kv) == len(tokens)
            await eventually(lambda: _found(on_c, tokens), 10, "h's prefix in c's lookup")
            link.cut()  # h's watch breaks; its lease (10 s) outlives the cut
            o.stop()
            o.start()  # epoch 2, empty: the records of h it kept are gone
            link.restore()
            await eventually(lambda: _found(on_c, tokens), 10, "h's prefix found through the restarted owner")
    finally:
        link.restore()
        h.stop()
        link.close()


async def test_a_holder_registered_anew_in_a_replaced_etcd_is_heard_by_an_owner_whose_watch_lags(
        cluster_nodes, etcd, tmp_path) -> None:
    """Defect 8: b had registered three times (epoch 3, which owner a heard); etcd was wiped and
    b restarted: etcd alone handed it epoch 1 again, and its republish reached a before a's watch
    said so: a refused it (epoch 1 is over, 3 was heard) and b never sent it again, so b's
    durable pages were a miss through a for good. Now b's epoch never goes back (its data
    directory keeps the last one), and a refusal for an incarnation the owner has not heard of
    yet is retried."""
    (b,) = cluster_nodes(["b"], "grpc", *TTL)
    link = TcpProxy(("127.0.0.1", etcd.client_port))
    a = Node(tmp_path, "a", f"etcd://127.0.0.1:{link.port}", "grpc", *TTL)
    try:
        a.start()
        for _ in range(2):
            b.stop()
            b.start()  # epoch 3 at the end
        tokens = tokens_owned_by(["a", "b"], {"a"}, 4)
        kv = random_kv(LAYOUT, len(tokens), seed=8)
        async with KVStoreClient(b.address, NS) as on_b:
            assert await on_b.put(tokens, kv, durable=True) == len(tokens)
        async with KVStoreClient(a.address, NS) as on_a:
            await eventually(lambda: _found(on_a, tokens), 10, "b's prefix in a's lookup")
            b.stop()
            etcd.wipe()
            await eventually(lambda: _registered(etcd.url, "a"), 30, "a registered in the new etcd")
            link.hold()  # a's watch lags from here: b's restart reaches a by b's republish first
            b.start()
            await asyncio.sleep(1.0)
            link.release()
            await eventually(lambda: _found(on_a, tokens), 10, "b's durable prefix found through a")
    finally:
        link.release()
        a.stop()
        link.close()


async def _found(client: KVStoreClient, tokens: list[int]) -> bool:
    return (await client.lookup(tokens)).num_tokens == len(tokens)


async def _registered(etcd_url: str, node: str) -> bool:
    members = await asyncio.to_thread(ctl_cluster, etcd_url)
    return node in {m["node"] for m in members["members"]}
