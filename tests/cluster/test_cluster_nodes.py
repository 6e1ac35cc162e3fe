"""Cluster mode end to end: a real etcd and three kvstore-server processes on loopback
(DESIGN §12). Engines are KVStoreClients on the nodes' shared memory."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from cluster_nodes import TTL_S, cluster_nodes, eventually  # noqa: F401  # the fixture
from conftest import random_kv
from etcd_proc import etcd_fixture  # noqa: F401  # the fixture

from kvstore import KVLayout, Namespace
from kvstore._proto import directory_pb2
from kvstore.client import KVStoreClient
from kvstore.errors import PageMissing

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)
NS = Namespace(model="cluster", revision="r1", layout=LAYOUT)


def tokens_of(seed: int, pages: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (pages * LAYOUT.page_tokens,), generator=g).tolist()


async def nodes_listed(client: KVStoreClient, tokens: list[int]) -> tuple[int, set[str]]:
    hit = await client.lookup(tokens)
    return hit.num_tokens, {run.node for run in hit.runs}


@pytest.mark.parametrize("data_plane", ["ucx", "grpc"])
async def test_prefix_put_on_one_node_is_found_and_read_on_another(cluster_nodes, data_plane: str) -> None:
    """An engine on node a stores a prefix; an engine on node c finds all of it with one
    lookup and reads it bit-exact through c's shared memory (the fetch copies it into c's
    host tier: the directory then lists both copies). A namespace invalidated at a reaches
    every node through etcd."""
    a, b, c = cluster_nodes(["a", "b", "c"], data_plane)
    tokens = tokens_of(1, 24)
    kv = random_kv(LAYOUT, len(tokens), seed=1)
    async with KVStoreClient(a.address, NS) as on_a, KVStoreClient(c.address, NS) as on_c:
        assert await on_a.put(tokens, kv) == len(tokens)
        assert on_c.shared_memory
        # records reach their owners asynchronously (batched off the commit path)
        await eventually(lambda: _found(on_c, tokens, len(tokens)), 5, "the prefix in c's lookup")
        hit = await on_c.lookup(tokens)
        assert hit.num_tokens == len(tokens) and {r.node for r in hit.runs} == {"a"}
        out = torch.zeros_like(kv)
        assert await on_c.get(hit, out) == len(tokens)
        assert torch.equal(out, kv)
        # c holds its own copy now, and lists it first
        hit = await on_c.lookup(tokens)
        assert {r.node for r in hit.runs} == {"c"} and hit.num_tokens == len(tokens)
        async with KVStoreClient(b.address, NS) as on_b:
            # a whole-namespace invalidation at a goes to every node through etcd
            await on_a._call(on_a.runtime.directory.Invalidate, directory_pb2.InvalidateRequest(namespace_id=NS.namespace_id))
            for client in (on_a, on_b, on_c):
                await eventually(lambda cl=client: _found(cl, tokens, 0), 5, "the namespace cleared on every node")


async def _found(client: KVStoreClient, tokens: list[int], num_tokens: int) -> bool:
    return (await client.lookup(tokens)).num_tokens == num_tokens
