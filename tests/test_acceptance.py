"""The foundation issue's acceptance example, run as written against a real server."""

from __future__ import annotations

import pytest
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


@pytest.mark.parametrize("chunk_bytes", [100_000, 8 << 20], ids=["rows-cut-across-chunks", "page-per-message"])
async def test_grpc_stream_pages_into_a_slice(server, chunk_bytes: int) -> None:
    """Over the socket, into a destination that is a slice of a bigger tensor, with pages
    cut across chunks (rows split mid-way) and with a whole page per message (copied and
    hashed in one pass): bit-exact, the rest untouched."""
    layout = KVLayout(num_layers=6, num_kv_heads=4, head_dim=96, dtype=torch.bfloat16, page_tokens=48)  # 432 KiB pages
    ns = Namespace(model="demo", revision="wide", layout=layout)
    tokens = list(range(200))
    kv = torch.randn(6, 2, 200, 4, 96).to(torch.bfloat16)
    async with KVStoreClient(server.address, ns, use_shm=False, chunk_bytes=chunk_bytes) as client:
        assert not client.shared_memory
        assert await client.put(tokens, kv[:, :, :200]) == 192
        hit = await client.lookup(tokens)
        big = torch.zeros(6, 2, 300, 4, 96, dtype=torch.bfloat16)
        await client.get(hit, into=big[:, :, 50:250])
        assert torch.equal(big[:, :, 50:242], kv[:, :, :192]) and not big[:, :, :50].any() and not big[:, :, 242:].any()
