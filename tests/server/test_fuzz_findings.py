"""Server defects found by `kvstore-bench fuzz`, each pinned by the request that found it."""

from __future__ import annotations

import grpc
from conftest import random_kv

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient


async def test_remove_with_a_key_twice_removes_it_once(server, layout, ns) -> None:
    """Bug (fuzz: 'reorder+duplicate RemoveRequest.keys'): Remove naming a page on SSD twice
    answered INTERNAL (KeyError): the SSD tier's batch delete popped the key twice, after
    its index transaction had deleted every key of the batch, so the pages after the
    duplicate stayed in the tier's map (and their slots allocated) with no index entry, and
    the directory still listed them. Now: OK, both pages gone, the SSD tier empty."""
    tokens = list(range(32))
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, random_kv(layout, 32), durable=True) == 32
        keys = client.keys(tokens)
    with grpc.insecure_channel(server.address) as channel:
        directory = directory_pb2_grpc.DirectoryStub(channel)
        removed = directory.Remove(directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=[keys[0], keys[0], keys[1]]),
                                   timeout=10)
        assert removed.num_removed == 2
        assert directory.Lookup(directory_pb2.LookupRequest(namespace_id=ns.namespace_id, keys=keys[1:]), timeout=10).num_pages == 0
        ssd = {t.tier: t for t in directory.Stats(directory_pb2.StatsRequest(), timeout=10).tiers}["ssd"]
        assert (ssd.num_pages, ssd.used_bytes) == (0, 0), "every SSD slot of the removed pages is free"
