"""The foundation issue's acceptance example, run as written against a real server."""

from __future__ import annotations

import torch

from kvstore import KVLayout, Namespace
from kvstore.client import KVStoreClient


async def example(addr: str) -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)
    ns = Namespace(model="demo", revision="r1", layout=layout)
    tokens = list(range(1000))
    kv = torch.randn(layout.num_layers, 2, len(tokens), layout.num_kv_heads, layout.head_dim).to(layout.dtype)
    async with KVStoreClient(addr, ns) as client:
        assert await client.put(tokens, kv) == 992          # full pages only
        hit = await client.lookup(tokens + [7, 8, 9])
        assert hit.num_tokens == 992
        out = torch.empty(layout.num_layers, 2, hit.num_tokens, layout.num_kv_heads,
                          layout.head_dim, dtype=layout.dtype)
        await client.get(hit, into=out)
        assert torch.equal(out, kv[:, :, :hit.num_tokens])
        other = Namespace(model="demo", revision="r2", layout=layout)
    async with KVStoreClient(addr, other) as client:
        assert (await client.lookup(tokens)).num_tokens == 0  # new revision: no reuse


async def test_acceptance_example(server) -> None:
    await example(server.address)


async def test_acceptance_example_over_grpc_stream(server, monkeypatch) -> None:
    """The same example with a client that cannot map the arena (another host)."""
    import kvstore.client.client as client_mod

    monkeypatch.setattr(client_mod.ArenaMap, "open", classmethod(lambda cls, *a: None))
    await example(server.address)
