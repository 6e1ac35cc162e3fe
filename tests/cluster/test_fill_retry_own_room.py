"""A fill cut short by this node (the tenant's host quota here, a landing full of pinned pages)
does not forget the cached lookup answers nor ask the owners again: only a holder that had fewer
pages than its record said does (RemoteTier.read_into_landing, NotedLanding). Found by a review
of that retry (2026-12-08): it was taken for any short fetch, so with an owner frozen between a
client's lookup and its get, a get at its tenant's quota waited on that owner (2 s, or the fetch
deadline) before answering the same pages it had at once before; the answer cache exists so that
an Acquire still fetches when an owner fails between the two (AnswerCache).

Three real nodes on a real etcd with tenants (as test_fetch_quotas): the prefix stored at a,
tenant a's host quota at c 4 pages, c reads 16 pages after its own lookup, owner b frozen between."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from quota_nodes import quota_nodes
from support.cluster_nodes import cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_auth import A
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore.client import KVStoreClient
from kvstore.errors import PageMissing

QUOTA_PAGES = 4


def _nodes(cluster_nodes, tmp_path: Path, monkeypatch) -> list:
    # a long membership ttl: the frozen owner stays a member for the whole test (as a node frozen by a GC
    # pause or a stalled disk does for its ttl); the fetch deadline well past the rpc timeout (2 s)
    return quota_nodes(cluster_nodes, tmp_path, monkeypatch, ["a", "b", "c"], QUOTA_PAGES, "--cluster-ttl", "30",
                       "--fetch-timeout-s", "4")


async def test_a_fill_cut_short_by_the_readers_own_quota_does_not_ask_the_owners_again(cluster_nodes, tmp_path,
                                                                                     monkeypatch) -> None:
    a, b, c = _nodes(cluster_nodes, tmp_path, monkeypatch)
    tokens = tokens_of(115, 16)
    kv = random_kv(LAYOUT, len(tokens), seed=115)
    async with KVStoreClient(a.address, NS, token=A) as on_a, KVStoreClient(c.address, NS, token=A) as on_c:
        assert await on_a.put(tokens, kv) == len(tokens)

        async def found() -> bool:
            return (await on_c.lookup(tokens)).num_tokens == len(tokens)

        await eventually(found, 10, "a's prefix in c's lookup")
        hit = await on_c.lookup(tokens)  # c caches what the other owners (a, b) answered for tenant a
        assert {r.node for r in hit.runs} == {"a"}, hit.runs
        b.freeze()  # an owner fails between the lookup and the get
        out = torch.zeros_like(kv)
        started = time.monotonic()
        with pytest.raises(PageMissing) as missing:
            await on_c.get(hit, out)
        waited = time.monotonic() - started
        got = missing.value.num_tokens  # type: ignore[attr-defined]
        assert got == QUOTA_PAGES * LAYOUT.page_tokens, got  # what tenant a's quota at c holds
        assert torch.equal(out[:, :, :got], kv[:, :, :got])
        assert waited < 1.0, (f"a get cut short by the reader's own quota ({got} of {len(tokens)} tokens) took {waited:.2f} s: "
                              "its fill forgot the cached answers and asked the owners again, the frozen one included")
