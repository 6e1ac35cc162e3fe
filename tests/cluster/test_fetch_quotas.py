"""Pages fetched from other nodes for a tenant count against its host quota at the node they land
at, as its puts do (DESIGN §11): a fill (get), a hint's prefetch and a replica take room in the
quota (the tenant's own coldest pages written down first), fetch only what fits, and leave
nothing behind; with nothing fitting (its pages pinned) nothing is fetched or charged.

Bug pinned here: remote fetches landed without the quota path (the tenant's arena part is its
host_bytes rounded up to a slab), so a tenant with a 4-page quota at c read 8 pages of a prefix
stored at a into c's host tier, and a replica put all 8 there too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.cluster_nodes import cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_auth import A, secure_args
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore._proto import data_pb2, directory_pb2
from kvstore.client import KVStoreClient
from kvstore.errors import PageMissing

NODE_TOKEN = "cluster-node-token-0123456789ab"
PAGE_BYTES = LAYOUT.num_layers * 2 * LAYOUT.page_tokens * LAYOUT.num_kv_heads * LAYOUT.head_dim * 2  # float16
QUOTA = 4 * PAGE_BYTES  # tenant a's host_bytes at c


async def _usage(client: KVStoreClient) -> tuple[dict[str, int], int]:
    """The caller's tenant's use at the client's node, and its leases there."""
    stats = await client._call(client.runtime.directory.Stats, directory_pb2.StatsRequest())
    return dict(next(t for t in stats.tenants).used), int(stats.num_leases)


async def _within_quota(client: KVStoreClient) -> bool:
    used, leases = await _usage(client)
    return used["host_bytes"] <= QUOTA and used["allocations"] == 0 and leases == 0


def _nodes(cluster_nodes, tmp_path: Path, monkeypatch) -> tuple[Any, Any]:
    """Nodes a and c of one cluster; tenant a may hold QUOTA host bytes at c."""
    from support.certs import CertAuthority

    monkeypatch.setenv("KVSTORE_CLUSTER_TOKEN", NODE_TOKEN)
    args = secure_args(tmp_path, CertAuthority(tmp_path / "ca"), ["a", "c"], NODE_TOKEN)
    auth = json.loads(Path(args["c"][1]).read_text())
    auth["quotas"] = {"a": {"host_bytes": QUOTA}}
    limited = tmp_path / "auth-c.json"
    limited.write_text(json.dumps(auth))
    limited.chmod(0o600)
    a, c = cluster_nodes(["a", "c"], "tcp", each={"a": args["a"][:2], "c": ["--auth-file", str(limited)]})
    return a, c


async def test_fetched_pages_count_against_the_tenants_host_quota(cluster_nodes, tmp_path, monkeypatch) -> None:
    a, c = _nodes(cluster_nodes, tmp_path, monkeypatch)
    read, hinted, replicated, last = tokens_of(71, 8), tokens_of(72, 8), tokens_of(73, 8), tokens_of(74, 8)
    kv = random_kv(LAYOUT, len(read), seed=71)
    async with KVStoreClient(a.address, NS, token=A) as on_a, KVStoreClient(c.address, NS, token=A) as on_c:
        assert await on_a.put(read, kv) == len(read)
        assert await on_a.put(hinted, random_kv(LAYOUT, len(hinted), seed=72)) == len(hinted)
        assert await on_a.put(last, random_kv(LAYOUT, len(last), seed=74)) == len(last)
        await eventually(lambda: _found(on_c, read), 5, "a's prefix in c's lookup")

        # a get at c: the prefix that fits in a's quota there, bit-exact; nothing pinned or allocated after
        out = torch.zeros_like(kv)
        with pytest.raises(PageMissing) as missing:
            await on_c.get(await on_c.lookup(read), out)
        got = missing.value.num_tokens  # type: ignore[attr-defined]
        assert 0 < got <= 4 * LAYOUT.page_tokens, got
        assert torch.equal(out[:, :, :got], kv[:, :, :got])
        assert await _within_quota(on_c), await _usage(on_c)

        # a hint's prefetch: its own coldest pages (the read's) make room, no more than the quota lands
        await eventually(lambda: _found(on_c, hinted), 5, "the hinted prefix in c's lookup")
        assert await on_c.hint(hinted, eta_s=1.0)
        await eventually(lambda: _listed_at(on_c, hinted, "c"), 5, "hinted pages fetched into c")
        await eventually(lambda: _within_quota(on_c), 5, "the prefetch settled within the quota")

        # a replica at c: as many pages as fit; the put answers the prefix two nodes hold
        held = await on_a.put(replicated, random_kv(LAYOUT, len(replicated), seed=73), replicas=2)
        assert held == 4 * LAYOUT.page_tokens, held
        assert await _within_quota(on_c), await _usage(on_c)

        # its quota full of its own pinned pages: a read fetches nothing, charges nothing, leaves nothing
        ns = on_c.namespace.namespace_id
        lease = await on_c._call(on_c.runtime.data.Acquire,
                                 data_pb2.AcquireRequest(namespace_id=ns, keys=on_c.keys(replicated)[:4], ttl_ms=30_000))
        assert len(lease.pages) == 4
        before, _ = await _usage(on_c)
        await eventually(lambda: _found(on_c, last), 5, "the last prefix in c's lookup")
        with pytest.raises(PageMissing) as missing:
            await on_c.get(await on_c.lookup(last), torch.zeros_like(kv))
        assert missing.value.num_tokens == 0  # type: ignore[attr-defined]
        after, leases = await _usage(on_c)
        assert after["host_bytes"] == before["host_bytes"] == QUOTA and after["allocations"] == 0 and leases == 1
        await on_c._call(on_c.runtime.data.Release, data_pb2.ReleaseRequest(lease_id=lease.lease_id))
        assert await _within_quota(on_c), await _usage(on_c)


async def test_a_fetch_makes_no_room_with_the_prefix_it_extends(cluster_nodes, tmp_path, monkeypatch) -> None:
    """Pages 0-3 of a prefix are at c (the whole quota), 4-7 at a: a get of the 8 pages at c takes
    no room by writing down pages 0-3 (it would read them up again past the quota): it fetches
    nothing and answers the 4 pages held."""
    a, c = _nodes(cluster_nodes, tmp_path, monkeypatch)
    tokens = tokens_of(75, 8)
    kv = random_kv(LAYOUT, len(tokens), seed=75)
    half = 4 * LAYOUT.page_tokens
    async with KVStoreClient(a.address, NS, token=A) as on_a, KVStoreClient(c.address, NS, token=A) as on_c:
        keys = on_a.keys(tokens)
        assert await on_c.put_keys(keys[:4], kv[:, :, :half].contiguous()) == half
        assert await on_a.put_keys(keys[4:], kv[:, :, half:].contiguous()) == half
        await eventually(lambda: _found(on_c, tokens), 5, "the whole prefix in c's lookup")
        out = torch.zeros_like(kv)
        with pytest.raises(PageMissing) as missing:
            await on_c.get(await on_c.lookup(tokens), out)
        assert missing.value.num_tokens == half  # type: ignore[attr-defined]
        assert torch.equal(out[:, :, :half], kv[:, :, :half])
        used, leases = await _usage(on_c)
        assert used["host_bytes"] == QUOTA and used["allocations"] == 0 and leases == 0, used


async def _found(client: KVStoreClient, tokens: list[int]) -> bool:
    return (await client.lookup(tokens)).num_tokens == len(tokens)


async def _listed_at(client: KVStoreClient, tokens: list[int], node: str) -> bool:
    hit = await client.lookup(tokens)
    return bool(hit.runs) and hit.runs[0].node == node
