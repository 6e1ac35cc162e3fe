"""Review of the saves' generation (DESIGN §3) in cluster mode: an Acquire at a node that fills
from another answers the generation read before its lease, and a layer-wise save naming it is
refused at that node once an invalidation made at another node was acknowledged."""

from __future__ import annotations

import pytest
from support.cluster_nodes import LAYOUT, NS, cluster_nodes_fixture, eventually, tokens_of  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv

from kvstore.client import KVStoreClient
from kvstore.client.transport import ShmTransport
from kvstore.errors import KVStoreError


async def _stored(client: KVStoreClient, tokens: list[int]) -> int:
    return (await client.lookup(tokens)).num_tokens


@pytest.mark.parametrize("data_plane", ["tcp"])
async def test_a_save_named_by_an_acquire_that_filled_from_another_node_is_refused_after_an_invalidation(
        cluster_nodes, data_plane: str) -> None:
    a, c = cluster_nodes(["a", "c"], data_plane)
    prefix = tokens_of(1, 4)
    tokens = prefix + tokens_of(2, 4)
    kv = random_kv(LAYOUT, len(tokens), seed=3)
    async with KVStoreClient(a.address, NS) as on_a, KVStoreClient(c.address, NS) as on_c:
        assert on_c.shared_memory and isinstance(on_c.transport, ShmTransport)
        assert await on_a.put(prefix, kv[:, :, : len(prefix)]) == len(prefix)
        await eventually(lambda: _found(on_c, prefix), 5, "a's prefix in c's lookup")
        acq = await on_c.transport.acquire(on_c.keys(tokens))  # c fills from a, then leases
        assert len(acq.pages) == 4 and acq.generation == 0
        await on_c.transport.release(acq.lease_id)
        assert await on_a.invalidate() == 1  # acknowledged once every node entered generation 1
        save = on_c.save(tokens, kv, start=len(prefix), generation=int(acq.generation))
        try:
            stored = await save.finished(10)
        except KVStoreError:
            stored = 0
        assert stored < len(tokens), "a save naming generation 0 was stored at c after the acknowledged invalidation"
        assert await _stored(on_c, tokens) == 0 and await _stored(on_a, tokens) == 0
        acq = await on_c.transport.acquire(on_c.keys(tokens))
        assert acq.generation == 1 and not acq.pages
        save = on_c.save(tokens, kv, start=0, generation=1)
        assert await save.finished(10) == len(tokens)
        await eventually(lambda: _found(on_a, tokens), 5, "c's save in a's lookup")


async def _found(client: KVStoreClient, tokens: list[int]) -> bool:
    return await _stored(client, tokens) == len(tokens)
