"""A node's cached lookup answer (AnswerCache, DESIGN §12) that names a holder which no longer
holds the pages (removed or evicted there, stored again at another node, the namespace's
generation unchanged) costs one short fetch, not every fill until the record expires: the
holder's MISSING makes the fill forget the record and ask the owners again. Before, each
fill of the TTL fetched from the old holder, got nothing, and the caller recomputed."""

from __future__ import annotations

import pytest
import torch
from support.cluster_nodes import cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore._proto import directory_pb2
from kvstore.client import KVStoreClient

CACHE_TTL_S = 30  # --cluster-ttl: the answer cache keeps a record this long


@pytest.mark.parametrize("data_plane", ["tcp", "grpc"])
async def test_a_fill_forgets_a_cached_answer_whose_holder_answers_missing(cluster_nodes, data_plane: str) -> None:
    a, b, c = cluster_nodes(["a", "b", "c"], data_plane, "--cluster-ttl", str(CACHE_TTL_S))
    tokens = tokens_of(41, 12)
    kv = random_kv(LAYOUT, len(tokens), seed=41)
    async with KVStoreClient(a.address, NS) as on_a, KVStoreClient(b.address, NS) as on_b, \
            KVStoreClient(c.address, NS) as on_c:
        assert await on_b.put(tokens, kv) == len(tokens)
        await eventually(lambda: _on(on_a, tokens, {"b"}), 5, "b's pages in a's lookup")
        old = await on_a.lookup(tokens)  # a caches what the other owners answered: at b
        keys = on_b.keys(tokens)
        removed = await on_b._call(on_b.runtime.directory.Remove,
                                   directory_pb2.RemoveRequest(namespace_id=NS.namespace_id, keys=keys))
        assert removed.num_removed == len(keys)
        assert await on_c.put(tokens, kv) == len(tokens)  # the same pages, now at c; no new generation
        # every owner knows: b's lookup asks them (and a's cache is left as it was)
        await eventually(lambda: _on(on_b, tokens, {"c"}), 5, "the pages at c in b's lookup")
        out = torch.zeros_like(kv)
        got = [await _got(on_a, old, out) for _ in range(2)]  # two fills from a, well within the cache's TTL
        assert got[-1] == len(tokens), f"tokens a's fills got: {got} (the second read the stale record again)"
        assert torch.equal(out, kv)


async def _on(client: KVStoreClient, tokens: list[int], nodes: set[str]) -> bool:
    hit = await client.lookup(tokens)
    return hit.num_tokens == len(tokens) and {r.node for r in hit.runs} == nodes


async def _got(client: KVStoreClient, hit: object, out: torch.Tensor) -> int:
    try:
        return await client.get(hit, out)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - a short get says how many tokens it placed
        return int(getattr(exc, "num_tokens", 0))
