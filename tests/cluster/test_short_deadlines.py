"""Remote reads under short deadlines (an engine's TTFT budget): a fetch uses the time its caller
has, never outlives the caller's deadline, and leaves nothing behind when it is cut.

Bug pinned here: ``ClusterRuntime.fill`` kept 0.25 s + 3 s of the caller's remaining time for a
cancelled fetch's clean-up, so a client with ``timeout_s=3.0`` fetched nothing at all (PageMissing
with 0 tokens for 4 pages a peer held); a replica asked for by ``put(replicas=2)`` within 3 s
copied nothing either."""

from __future__ import annotations

import signal

import pytest
import torch
from support.cluster_nodes import cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_nodes import LAYOUT, NS, ctl_cluster, tokens_of

from kvstore._proto import directory_pb2
from kvstore.client import KVStoreClient
from kvstore.errors import PageMissing

SHORT_S = 3.0  # the client's deadline: every call, the fill's included, ends within it


async def _host(client: KVStoreClient) -> directory_pb2.TierStats:
    stats = await client._call(client.runtime.directory.Stats, directory_pb2.StatsRequest())
    return next(t for t in stats.tiers if t.tier == "host")


async def _leases(client: KVStoreClient) -> int:
    return int((await client._call(client.runtime.directory.Stats, directory_pb2.StatsRequest())).num_leases)


async def _found(client: KVStoreClient, tokens: list[int], num_tokens: int) -> bool:
    return (await client.lookup(tokens)).num_tokens == num_tokens


@pytest.mark.parametrize("data_plane", ["ucx", "tcp", "grpc"])
async def test_a_remote_read_with_a_short_deadline_fetches(cluster_nodes, data_plane: str) -> None:
    """4 pages stored at a, read at c by a client whose every call has 3 s: c fetches them
    within the call (bit-exact) and holds its own copy after."""
    a, c = cluster_nodes(["a", "c"], data_plane)
    tokens = tokens_of(61, 4)
    kv = random_kv(LAYOUT, len(tokens), seed=61)
    async with KVStoreClient(a.address, NS) as on_a, KVStoreClient(c.address, NS, timeout_s=SHORT_S) as on_c:
        assert await on_a.put(tokens, kv) == len(tokens)
        await eventually(lambda: _found(on_c, tokens, len(tokens)), 5, "a's prefix in c's lookup")
        out = torch.zeros_like(kv)
        assert await on_c.get(await on_c.lookup(tokens), out) == len(tokens)
        assert torch.equal(out, kv)
        assert {r.node for r in (await on_c.lookup(tokens)).runs} == {"c"}


async def test_a_short_read_cut_by_a_frozen_holder_leaves_nothing_behind(cluster_nodes) -> None:
    """Pages 0-3 at a, 4-7 at b; b freezes (SIGSTOP) and c reads the 8 pages with 3 s per call:
    the get answers within its deadline with a's 4 pages (PageMissing, num_tokens of 4 pages),
    and b's landing slots are given back: c holds 4 pages, no lease, no allocation."""
    a, b, c = cluster_nodes(["a", "b", "c"], "tcp")
    tokens = tokens_of(62, 8)
    kv = random_kv(LAYOUT, len(tokens), seed=62)
    half = 4 * LAYOUT.page_tokens
    async with KVStoreClient(a.address, NS) as on_a, KVStoreClient(b.address, NS) as on_b:
        keys = on_a.keys(tokens)
        assert await on_a.put_keys(keys[:4], kv[:, :, :half].contiguous()) == half
        assert await on_b.put_keys(keys[4:], kv[:, :, half:].contiguous()) == half
        held_by_a = await _host(on_a)  # 4 pages' slots, nothing reserved
    async with KVStoreClient(c.address, NS, timeout_s=SHORT_S) as on_c:
        await eventually(lambda: _found(on_c, tokens, len(tokens)), 5, "the whole prefix in c's lookup")
        hit = await on_c.lookup(tokens)
        b.freeze()
        try:
            out = torch.zeros_like(kv)
            with pytest.raises(PageMissing) as missing:
                await on_c.get(hit, out)
            assert missing.value.num_tokens == half  # type: ignore[attr-defined]
            assert torch.equal(out[:, :, :half], kv[:, :, :half]) and not out[:, :, half:].any()

            async def settled() -> bool:  # a cut fetch's clean-up may finish just after the answer
                host, num_leases = await _host(on_c), await _leases(on_c)
                return host.num_pages == 4 and host.used_bytes == held_by_a.used_bytes and num_leases == 0
            await eventually(settled, 10, "c holding a's 4 pages only, nothing leased or allocated")
        finally:
            b.signal(signal.SIGCONT)


async def test_a_replica_within_a_short_deadline_is_made(cluster_nodes, etcd) -> None:
    """``put(replicas=2)`` by a client with 3 s per call: the other node copies the pages within
    the call and the put answers them replicated."""
    a, _ = cluster_nodes(["a", "b"], "ucx")  # its first fetch connects (a grant, then UCX): more than 10 ms
    tokens = tokens_of(63, 16)
    async with KVStoreClient(a.address, NS, timeout_s=SHORT_S) as on_a:
        assert await on_a.put(tokens, random_kv(LAYOUT, len(tokens), seed=63), replicas=2) == len(tokens)
    host_pages = {m["node"]: m["tiers"]["host"]["pages"] for m in ctl_cluster(etcd.url)["members"]}
    assert host_pages == {"a": 16, "b": 16}
