"""An acknowledged namespace invalidation holds at every node, whatever is in flight when it
happens (DESIGN §12.4): a fetch that lands after it, a holder whose etcd
watch lags, a key invalidated at one node while another still holds the page."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from invalidation_cases import invalidate, proxied, read_checked, served, tokens_owned_by
from support.cluster_nodes import Node, cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from support.tcp_proxy import TcpProxy
from test_cluster_nodes import LAYOUT, NS

from kvstore.client import KVStoreClient

SLOW = ("--fetch-timeout-s", "20")


async def test_a_fetch_that_lands_after_an_invalidation_is_not_committed(cluster_nodes, etcd, tmp_path) -> None:
    """Defect 1: r fetches h's pages over a link held back; the namespace is invalidated
    meanwhile; then the bytes land. Before, r committed and published them: every node then
    served the invalidated bytes. Now the fetch's allocation belongs to the old generation and
    its commit is refused: no read that starts after the invalidation is served them."""
    r, c = cluster_nodes(["r", "c"], "grpc", *SLOW)
    h, link = proxied(tmp_path, "h", etcd.url, "grpc", *SLOW)
    try:
        h.start()
        tokens = tokens_owned_by(["c", "h", "r"], {"c", "r"}, 4)  # r's lookup asks r and c only: h's link is for bytes
        warm = tokens_owned_by(["c", "h", "r"], {"c", "r"}, 1, first_seed=9000)
        kv, kv_warm = random_kv(LAYOUT, len(tokens), seed=1), random_kv(LAYOUT, len(warm), seed=9)
        async with KVStoreClient(h.address, NS) as on_h:
            assert await on_h.put(tokens, kv) == len(tokens)
            assert await on_h.put(warm, kv_warm) == len(warm)
        async with KVStoreClient(r.address, NS) as on_r:
            await eventually(lambda: _found(on_r, tokens), 10, "h's prefix in r's lookup")
            await eventually(lambda: _found(on_r, warm), 10, "h's other prefix in r's lookup")
            # r's channel to h is open before the hold (a connection's handshake would be held too)
            assert await read_checked(r.address, warm, kv_warm, "the warm-up read") == len(warm)
            link.hold()  # what h sends its peers waits from here
            reader = asyncio.create_task(read_checked(r.address, tokens, kv, "the read in flight"))
            await asyncio.sleep(1.0)  # r asked h for the pages; the answer is held
            await invalidate(h.address, NS.namespace_id)  # at h itself (its own address is not held)
            await asyncio.sleep(1.5)  # the others heard of it
            link.release()
            await reader  # in flight across the invalidation: old bytes or none, never wrong ones
            await asyncio.sleep(1.0)  # r's commit and its publish to the owners
            for node in (r, c, h):
                assert await served(node.address, tokens) == 0, f"{node.name} served invalidated pages"
    finally:
        link.release()
        h.stop()
        link.close()


async def test_a_holder_whose_watch_lags_leaves_no_phantom_records(cluster_nodes, etcd, tmp_path) -> None:
    """Defect 6: h's etcd watch lags; the namespace is invalidated at a; h stores a prefix
    (in the old generation, as far as it knows) and publishes it to its owners; then h hears
    of the invalidation and clears its pages, withdrawing nothing. Before, the owners kept
    promising the prefix and every get raised PageMissing, at every node. Now a lookup's
    promise is kept or withdrawn."""
    a, c = cluster_nodes(["a", "c"], "grpc", "--cluster-ttl", "5")
    etcd_link = TcpProxy(("127.0.0.1", etcd.client_port))
    h = Node(tmp_path, "h", f"etcd://127.0.0.1:{etcd_link.port}", "grpc", "--cluster-ttl", "5")
    try:
        h.start()
        tokens = tokens_owned_by(["a", "c", "h"], {"a", "c"}, 4)
        kv = random_kv(LAYOUT, len(tokens), seed=2)
        # a's first invalidation waits a TTL from a's start (a node of a replaced etcd might not know yet: cluster_generations.py);
        # h's lease (5 s) outlives the hold below only if that wait is over before it
        await invalidate(a.address, NS.namespace_id)
        etcd_link.hold()  # h's watch lags from here (its requests still reach etcd)
        await invalidate(a.address, NS.namespace_id)
        async with KVStoreClient(h.address, NS) as on_h:
            assert await on_h.put(tokens, kv) == len(tokens)
        async with KVStoreClient(c.address, NS) as on_c:
            await eventually(lambda: _found(on_c, tokens), 10, "h's prefix in c's lookup")
        etcd_link.release()
        await asyncio.sleep(2.0)  # h heard of the invalidation
        for node in (a, c, h):  # a promise is delivered whole, with the bytes put
            async with KVStoreClient(node.address, NS) as client:
                promised = (await client.lookup(tokens)).num_tokens
            got = await read_checked(node.address, tokens, kv, f"read at {node.name}")
            assert got == promised, f"{node.name} promised {promised} tokens and delivered {got}"
    finally:
        etcd_link.release()
        h.stop()
        etcd_link.close()


async def test_a_key_invalidation_is_refused_in_cluster_mode(cluster_nodes, etcd) -> None:
    """Defect 4: Invalidate(keys) removed the pages at one node only, which then fetched them
    straight back from another holder and served them. A page removed at one node cannot be
    kept from coming back from another without per-key generations, so in cluster mode the
    call is refused (INVALID_ARGUMENT, naming the namespace invalidation to use) and nothing
    changes."""
    r, h = cluster_nodes(["r", "h"], "grpc")
    tokens = tokens_owned_by(["h", "r"], {"h", "r"}, 4)
    kv = random_kv(LAYOUT, len(tokens), seed=3)
    async with KVStoreClient(h.address, NS) as on_h, KVStoreClient(r.address, NS) as on_r:
        assert await on_h.put(tokens, kv) == len(tokens)
        await eventually(lambda: _found(on_r, tokens), 10, "h's prefix in r's lookup")
        assert await read_checked(r.address, tokens, kv, "the first read at r") == len(tokens)  # r holds a copy now
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await invalidate(r.address, NS.namespace_id, on_r.keys(tokens))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "invalidate the whole namespace" in refused.value.details()
        assert await read_checked(r.address, tokens, kv, "the read after the refusal") == len(tokens)


async def _found(client: KVStoreClient, tokens: list[int]) -> bool:
    return (await client.lookup(tokens)).num_tokens == len(tokens)
