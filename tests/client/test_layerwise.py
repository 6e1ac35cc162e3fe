"""Layer-wise load and save, paged engine KV, deadlines and partial prefixes."""

from __future__ import annotations

import asyncio
import time

import grpc
import torch
from support.kv import random_kv

from kvstore import KVLayout, Namespace
from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.client.engine_kv import PagedKV


def _paged_from(kv: torch.Tensor, layout: KVLayout, block_size: int, seed: int = 0) -> PagedKV:
    tokens = kv.shape[2]
    num_blocks = -(-tokens // block_size) + 3
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: -(-tokens // block_size)].tolist()
    layers = [torch.zeros(num_blocks, 2, block_size, layout.num_kv_heads, layout.head_dim, dtype=kv.dtype) for _ in range(layout.num_layers)]
    paged = PagedKV(layers, table, tokens, layout)
    for t in range(tokens):
        for layer in range(layout.num_layers):
            layers[layer][table[t // block_size], :, t % block_size] = kv[layer, :, t]
    return paged


async def test_paged_kv_roundtrip(server, layout, ns) -> None:
    tokens = list(range(200))
    kv = random_kv(layout, 200, seed=21)
    paged = _paged_from(kv, layout, block_size=8)
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, paged) == 192
        hit = await client.lookup(tokens)
        out = torch.zeros_like(kv)
        await client.get(hit, into=out)
        assert torch.equal(out[:, :, :192], kv[:, :, :192])
        target = _paged_from(torch.zeros_like(kv), layout, block_size=32, seed=3)
        await client.get(hit, into=target)
        for page in range(12):
            for layer in range(layout.num_layers):
                assert torch.equal(target.read_layer(page, layer), kv[layer, :, page * 16 : (page + 1) * 16])


async def test_layerwise_load_and_save(server, layout, ns) -> None:
    tokens = list(range(320))
    kv = random_kv(layout, 320, seed=22)
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens[:160], kv[:, :, :160]) == 160
        hit = await client.lookup(tokens)
        assert hit.num_tokens == 160
        into = torch.zeros_like(kv)
        load = client.load(hit, into=into, ahead=2, deadline_s=30)
        for layer in range(layout.num_layers):
            assert load.wait(layer)
            assert torch.equal(into[layer, :, :160], kv[layer, :, :160])
        assert await load.finished() == 160
        save = client.save(tokens, kv, start=hit.num_tokens)
        save.layer_done(0)
        save.layer_done(1)
        await asyncio.sleep(0.2)
        assert (await client.lookup(tokens)).num_tokens == 160, "pages are published only once all layers are stored"
        save.layer_done(2)
        save.layer_done(3)
        assert await save.finished() == 320
        hit = await client.lookup(tokens)
        assert hit.num_tokens == 320
        out = torch.empty_like(kv)
        await client.get(hit, into=out)
        assert torch.equal(out, kv)


async def test_layerwise_over_grpc(server, layout, ns, monkeypatch) -> None:
    import kvstore.client.client as client_mod

    monkeypatch.setattr(client_mod.ArenaMap, "open", classmethod(lambda cls, *a: None))
    tokens = list(range(100))
    kv = random_kv(layout, 100, seed=23)
    async with KVStoreClient(server.address, ns) as client:
        save = client.save(tokens, kv)
        assert await save.finished() == 96
        hit = await client.lookup(tokens)
        into = torch.zeros_like(kv)
        load = client.load(hit, into=into, deadline_s=30)
        assert all(load.wait(i) for i in range(layout.num_layers))
        assert await load.finished() == 96 and torch.equal(into[:, :, :96], kv[:, :, :96])


async def test_deadline_means_recompute_and_no_late_writes(server, layout, ns, monkeypatch) -> None:
    """A page that arrives late is not waited on past the deadline, and the late bytes
    never land in the engine's KV."""
    tokens = list(range(160))
    kv = random_kv(layout, 160, seed=24)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        real = client.transport.acquire

        async def slow_acquire(keys):  # type: ignore[no-untyped-def]
            await asyncio.sleep(0.6)
            return await real(keys)

        monkeypatch.setattr(client.transport, "acquire", slow_acquire)
        into = torch.zeros_like(kv)
        load = client.load(hit, into=into, deadline_s=0.2)
        start = time.monotonic()
        assert load.wait(0) is False
        assert time.monotonic() - start < 0.5
        assert load.num_tokens == 0 and await load.finished() == 0
        await asyncio.sleep(0.8)
        assert not into.any(), "nothing may be written after the load is abandoned"
        assert not load.wait(1)
        before = time.monotonic()  # the deadline counts from the load's start, not from this check (a slow host's gap)
        default = client.load(hit, into=torch.zeros_like(kv))
        assert 0.05 <= default.deadline - before <= 1.0, "default deadline derives from the recompute estimate"


async def test_missing_page_shortens_the_layerwise_prefix(server, layout, ns) -> None:
    tokens = list(range(160))
    kv = random_kv(layout, 160, seed=25)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        with grpc.insecure_channel(server.address) as ch:
            directory_pb2_grpc.DirectoryStub(ch).Remove(directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=[hit.keys[4]]))
        into = torch.zeros_like(kv)
        load = client.load(hit, into=into, deadline_s=30)
        assert load.wait(0) and load.num_tokens == 64
        assert all(load.wait(i) for i in range(layout.num_layers))
        assert torch.equal(into[:, :, :64], kv[:, :, :64]) and not into[:, :, 64:].any()


async def test_suggest_ahead_matches_the_chapter(server) -> None:
    qwen = Namespace(model="q", revision="r", layout=KVLayout(36, 8, 128, dtype=torch.bfloat16))
    async with KVStoreClient(server.address, qwen) as client:
        assert client.suggest_ahead(8192, 256, compute_s_per_token=0.0309 / 256, bandwidth_bps=25e9) == 14
        assert client.suggest_ahead(8192, 1000, compute_s_per_token=0.0309 / 256, bandwidth_bps=25e9) == 0


async def test_a_corrupt_page_found_as_it_is_copied_cuts_the_load(server, layout, ns) -> None:
    """Into a CPU tensor a page is checked as its layers are copied (one read of the
    bytes), not before: a page corrupt at rest is found once its last layer is in. The
    last wait then says so (earlier ones do too once the load ended), and only the pages
    before it count."""
    tokens = list(range(128))
    kv = random_kv(layout, 128, seed=26)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        assert client.arena is not None
        offset = server.core.where(hit.keys[5])["host"]  # read, to aim the fault
        client.arena.array[offset + 100] ^= 0x10
        into = torch.zeros_like(kv)
        load = client.load(hit, into=into, deadline_s=30)
        assert load.wait(layout.num_layers - 1) is False
        assert load.num_tokens == 80 and await load.finished() == 80
        assert torch.equal(into[:, :, :80], kv[:, :, :80])
        assert not server.core.view().pinned
