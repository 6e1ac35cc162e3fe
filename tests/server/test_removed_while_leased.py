"""A page removed while a reader holds it, then stored again before the reader lets go."""

from __future__ import annotations

import grpc
import pytest
import torch
from support.kv import random_kv

from kvstore._proto import data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient


@pytest.mark.parametrize("durable", [False, True], ids=["ram", "durable"])
async def test_a_page_removed_while_leased_and_stored_again_survives_the_release(server_factory, layout, ns, durable: bool) -> None:
    """Bug: removing a leased page only marked it 'doomed'; a put of the same page before
    the lease ended installed the new copy over the old index entry (leaking the old slot),
    and the lease's release then freed the new copy: the directory listed a page whose bytes
    were gone (get: PageMissing) and a slot stayed used forever."""
    server = server_factory() if durable else server_factory(ssd_bytes=None)
    tokens = list(range(16))
    kv = random_kv(layout, 16, seed=3)
    async with KVStoreClient(server.address, ns) as client, grpc.aio.insecure_channel(server.address) as channel:
        data, directory = data_pb2_grpc.DataStub(channel), directory_pb2_grpc.DirectoryStub(channel)
        assert await client.put(tokens, kv, durable=durable) == 16
        keys = client.keys(tokens)
        lease = await data.Acquire(data_pb2.AcquireRequest(namespace_id=ns.namespace_id, keys=keys, ttl_ms=60_000))
        assert len(lease.pages) == 1
        await directory.Remove(directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=keys))
        assert await client.put(tokens, kv, durable=durable) == 16, "stored again while the old copy is still leased"
        await data.Release(data_pb2.ReleaseRequest(lease_id=lease.lease_id))
        hit = await client.lookup(tokens)
        assert hit.num_tokens == 16 and {loc.tier for loc in hit.locations} == {"host"}
        out = torch.zeros_like(kv)
        await client.get(hit, into=out)
        assert torch.equal(out, kv)
        stats = await directory.Stats(directory_pb2.StatsRequest())
    for tier in stats.tiers:
        assert (tier.num_pages, tier.used_bytes // 4096) == (1, -(-layout.page_bytes // 4096) + (tier.tier == "ssd")), \
            f"{tier.tier}: the removed copy's slot was given back"
