"""A direct handoff the decode node's tenant quota cuts short is answered at once (DESIGN §12.7).
The prefill node's Complete answers with what the decode node holds (4 of 8 pages); before, the
decode node completed its marker with every key the Push named (HandoffGate.push), so a decode's
wait for the whole prompt never saw it complete and slept out its whole deadline (the connector's
default: 10 s) before answering the same 4 pages. Through the pool: pulls that the quota holds
short, landing nothing, end the wait after a while (HandoffMarkers.QUOTA_PATIENCE_S), not at its
deadline; a quota only momentarily full (another read's pins) does not end it. Found by
adversarial reviews (2026-12-08). Two real nodes on a real etcd with tenants, as test_handoff_tenants.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from quota_nodes import quota_nodes
from support.cluster_nodes import cluster_nodes_fixture  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_auth import A
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore._proto import data_pb2
from kvstore.client import KVStoreClient, new_handoff_id
from kvstore.server.handoff_markers import QUOTA_PATIENCE_S

DEADLINE_S = 10.0


def _nodes(cluster_nodes, tmp_path: Path, monkeypatch, quota_pages: int = 4) -> list:
    """Nodes a and c with tenants; tenant a's host quota at c is ``quota_pages``."""
    return quota_nodes(cluster_nodes, tmp_path, monkeypatch, ["a", "c"], quota_pages)


async def test_a_handoff_cut_short_by_the_quota_is_answered_without_waiting_out_the_deadline(cluster_nodes, tmp_path,
                                                                                          monkeypatch) -> None:
    a, c = _nodes(cluster_nodes, tmp_path, monkeypatch)
    tokens = tokens_of(53, 8)
    kv = random_kv(LAYOUT, len(tokens), seed=53)
    async with KVStoreClient(a.address, NS, token=A) as prefill, KVStoreClient(c.address, NS, token=A) as decode:
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, "c", tokens=tokens)
        assert await prefill.put(tokens, kv) == len(tokens)
        handed = await prefill.handoff_complete(handoff, tokens)
        assert 0 < handed < len(tokens), handed  # the handoff is over: Complete answered what c holds
        started = time.monotonic()
        hit = await decode.handoff_wait(handoff, tokens, deadline_s=DEADLINE_S)
        waited = time.monotonic() - started
        assert hit.num_tokens == handed
        assert waited < 4.0, (f"the decode's wait for a handoff that was complete ({handed} of {len(tokens)} tokens, "
                              f"the rest over the tenant's quota at c) took {waited:.1f} s: its whole deadline "
                              f"({DEADLINE_S:.0f} s)")


async def test_a_pool_handoff_cut_short_by_the_quota_is_answered_without_waiting_out_the_deadline(cluster_nodes, tmp_path,
                                                                                               monkeypatch) -> None:
    """The same through the pool (no decode node named): the decode node's pulls land what its
    tenant's quota holds, and the wait answers that once a pull could land nothing more."""
    a, c = _nodes(cluster_nodes, tmp_path, monkeypatch)
    tokens = tokens_of(54, 8)
    kv = random_kv(LAYOUT, len(tokens), seed=54)
    async with KVStoreClient(a.address, NS, token=A) as prefill, KVStoreClient(c.address, NS, token=A) as decode:
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, None, tokens=tokens)
        assert await prefill.put(tokens, kv) == len(tokens)
        assert await prefill.handoff_complete(handoff, tokens) == len(tokens)
        started = time.monotonic()
        hit = await decode.handoff_wait(handoff, tokens, deadline_s=DEADLINE_S)
        waited = time.monotonic() - started
        assert 0 < hit.num_tokens < len(tokens), hit.num_tokens
        assert QUOTA_PATIENCE_S <= waited < 4.0, (f"the decode's wait for a pool handoff over the tenant's quota took "
                                                  f"{waited:.1f} s (deadline {DEADLINE_S:.0f} s)")


async def test_a_pool_handoff_does_not_give_up_on_a_quota_only_momentarily_full(cluster_nodes, tmp_path, monkeypatch) -> None:
    """Tenant a's quota at c is 8 pages; 6 pages of its other prompt there are leased (another
    request's read) when the wait starts and let go 0.5 s later; the pool handoff is 4 pages:
    every page arrives (an earlier fix answered 2 of them at the first pull the quota held short)."""
    a, c = _nodes(cluster_nodes, tmp_path, monkeypatch, quota_pages=8)
    other, tokens = tokens_of(1151, 6), tokens_of(1152, 4)
    async with KVStoreClient(a.address, NS, token=A) as prefill, KVStoreClient(c.address, NS, token=A) as decode:
        # the tenant's other prompt at c, read by another request meanwhile (leased: not evictable)
        assert await decode.put(other, random_kv(LAYOUT, len(other), seed=1151)) == len(other)
        ns = decode.namespace.namespace_id
        lease = await decode._call(decode.runtime.data.Acquire,
                                   data_pb2.AcquireRequest(namespace_id=ns, keys=decode.keys(other), ttl_ms=30_000))
        assert len(lease.pages) == len(other) // LAYOUT.page_tokens

        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, None, tokens=tokens)  # through the pool
        assert await prefill.put(tokens, random_kv(LAYOUT, len(tokens), seed=1152)) == len(tokens)
        assert await prefill.handoff_complete(handoff, tokens) == len(tokens)

        async def let_go_soon() -> None:  # the other request's read ends
            await asyncio.sleep(0.5)
            await decode._call(decode.runtime.data.Release, data_pb2.ReleaseRequest(lease_id=lease.lease_id))

        release = asyncio.create_task(let_go_soon())
        started = time.monotonic()
        hit = await decode.handoff_wait(handoff, tokens, deadline_s=DEADLINE_S)
        waited = time.monotonic() - started
        await release
        assert hit.num_tokens == len(tokens), (
            f"the pool handoff's wait answered {hit.num_tokens} of {len(tokens)} tokens after {waited:.2f} s: it stopped "
            f"pulling at the first pull the quota held short, though the pins holding the quota went 0.5 s later "
            f"(deadline {DEADLINE_S:.0f} s)")
