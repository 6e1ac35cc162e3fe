"""durable=True means every page of the returned prefix is on SSD when the call returns,
pages that were already stored in RAM included, or the call raises."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest
import torch
from support.hf_model import namespace_for, tiny_qwen3
from support.kv import random_kv

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.client.adapters.hf import HFKVCache
from kvstore.errors import PageMissing, TierUnavailable


async def _put(client: KVStoreClient, tokens: list[int], kv: torch.Tensor) -> int:
    return await client.put(tokens, kv, durable=True)


async def _layer_save(client: KVStoreClient, tokens: list[int], kv: torch.Tensor) -> int:
    save = client.save(tokens, kv, durable=True)
    for layer in range(client.layout.num_layers):
        save.layer_done(layer)
    return await save.finished()


async def _checkpoint(client: KVStoreClient, tokens: list[int], kv: torch.Tensor) -> int:
    return await client.session("s1", checkpoint="write-through").checkpoint(tokens, kv)


WRITERS: dict[str, Callable[[KVStoreClient, list[int], torch.Tensor], Awaitable[int]]] = {
    "put": _put, "layer-save": _layer_save, "session-checkpoint": _checkpoint,
}


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "grpc"])
@pytest.mark.parametrize("writer", list(WRITERS))
async def test_durable_write_over_a_ram_prefix_survives_sigkill(server_process, layout, ns, writer: str, use_shm: bool) -> None:
    """Bug: tokens[:32] stored RAM-only, then a durable write of 64 tokens returned 64 while
    only the two new pages went to SSD (the shm path and LayerSave committed only newly
    allocated slots); after SIGKILL lookup found 0 tokens."""
    server_process.start()
    tokens = list(range(64))
    kv = random_kv(layout, 64, seed=11)
    async with KVStoreClient(server_process.address, ns, use_shm=use_shm) as client:
        assert client.shared_memory is use_shm
        assert await client.put(tokens[:32], kv) == 32  # RAM only
        assert await WRITERS[writer](client, tokens, kv) == 64
    server_process.kill()
    server_process.start()
    async with KVStoreClient(server_process.address, ns, use_shm=use_shm) as client:
        hit = await client.lookup(tokens)
        assert hit.num_tokens == 64, "every page of an acknowledged durable write survives SIGKILL"
        out = torch.zeros_like(kv)
        await client.get(hit, into=out)
        assert torch.equal(out, kv)
    assert server_process.terminate() == 0


async def test_hf_save_durable_over_a_ram_prefix_survives_sigkill(server_process) -> None:
    """Bug (as above) through HFKVCache.save(durable=True): a prefix saved RAM-only first
    was lost at SIGKILL although the durable save reported it stored."""
    torch.set_num_threads(1)
    model, config = tiny_qwen3()
    prompt = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        past = model(prompt, use_cache=True).past_key_values
    server_process.start()
    async with KVStoreClient(server_process.address, namespace_for(config)) as client:
        cache = HFKVCache(client, config)
        assert await cache.save(prompt[:, :48], past) == 48  # RAM only
        assert await cache.save(prompt, past, durable=True) == 96
    server_process.kill()
    server_process.start()
    async with KVStoreClient(server_process.address, namespace_for(config)) as client:
        n, restored = await HFKVCache(client, config).restore(prompt)
        assert n == 96
        for layer in range(config.num_hidden_layers):
            assert torch.equal(restored.layers[layer].keys, past.layers[layer].keys[:, :, :96])
            assert torch.equal(restored.layers[layer].values, past.layers[layer].values[:, :, :96])
    assert server_process.terminate() == 0


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "grpc"])
async def test_durable_put_without_ssd_tier_is_a_clear_error(server_factory, layout, ns, use_shm: bool) -> None:
    """Bug: put(durable=True) on a server without an ssd tier returned success with the
    pages in RAM only. It raises, and the rejected write leaves no page, slot or pin."""
    server = server_factory(ssd_bytes=None)
    tokens = list(range(40 * 16))  # several batches: the ones allocated ahead are given back too
    async with KVStoreClient(server.address, ns, use_shm=use_shm) as client:
        with pytest.raises(TierUnavailable, match="no ssd tier"):
            await client.put(tokens, random_kv(layout, len(tokens)), durable=True)
        assert (await client.lookup(tokens)).num_tokens == 0
    view = server.core.view()
    assert view.tiers["host"].used_bytes == 0 and view.idle


async def test_durable_commit_reports_only_the_prefix_on_ssd(server, layout, ns) -> None:
    """Bug: a durable commit answered with the keys it was given; a page of the allocated
    prefix removed between Allocate and Commit left a hole the client never saw. The
    commit counts the allocation's leading pages that are on SSD."""
    from kvstore.page import LayoutDesc, checksum

    core = server.core
    async with KVStoreClient(server.address, ns) as client:
        await client.put(list(range(16)), random_kv(layout, 16))
        keys = client.keys(list(range(32)))
    ident, slots = core.allocate(ns.namespace_id, LayoutDesc.of(layout), keys)
    assert [offset is None for _, offset in slots] == [True, False]
    core.remove(ns.namespace_id, keys[:1])  # another caller removes page 0 meanwhile
    view = core.slot_view(ident, keys[1])
    assert core.commit(ident, keys[1:], [checksum(view)], durable=True) == 0
    assert core.view().idle


async def test_layer_save_raises_when_the_durable_prefix_is_short(server, layout, ns) -> None:
    """Bug: LayerSave ignored the server's num_published and reported the whole range
    durable. Page 0 existed at Allocate and is removed before the commit: finished()
    raises with the tokens actually durable (0)."""
    tokens = list(range(48))
    kv = random_kv(layout, 48, seed=2)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens[:16], kv)
        save = client.save(tokens, kv, durable=True)
        while not server.core.view().num_allocations:  # the worker allocates at once; reading, not steering
            await asyncio.sleep(0.005)
        async with grpc.aio.insecure_channel(server.address) as ch:
            await directory_pb2_grpc.DirectoryStub(ch).Remove(
                directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=client.keys(tokens)[:1]))
        for layer in range(layout.num_layers):
            save.layer_done(layer)
        with pytest.raises(PageMissing) as err:
            await save.finished()
        assert err.value.num_tokens == 0


async def test_durable_put_keeps_the_stored_prefix_it_was_promised(server_factory, tmp_path, layout, ns) -> None:
    """Bug: Allocate answered 'stored already' for a RAM prefix but did not hold it; the
    same put's next allocation evicted it (SSD admission refused it: dropped), and the
    durable put failed, or (before the commit counted) reported pages that were gone.
    The pages an allocation calls stored stay pinned until its commit, abort or expiry."""
    import dataclasses

    from support.servers import make_config

    config = make_config(tmp_path, host_bytes=8 << 20)
    config = dataclasses.replace(config, ssd=dataclasses.replace(config.ssd, admission="seen-twice"))  # one-shot: dropped
    # Only allocations evict (no background demoter): otherwise it may drop the filler's
    # one-shot pages between its put and its lookup, and the check below races it.
    config = dataclasses.replace(config, host=dataclasses.replace(config.host, demote_above=1.0, demote_to=1.0))
    server = server_factory(config)
    host_pages = server.core.view().tiers["host"].capacity_bytes // layout.page_bytes
    prefix, new = list(range(8 * 16)), list(range(10**6, 10**6 + 16 * 16))
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(prefix, random_kv(layout, len(prefix))) == len(prefix)  # RAM only, oldest in LRU
        filler = list(range(10**7, 10**7 + (host_pages - 8) * 16))
        # Host tier now full. SSD admission drops one-shot pages, and the tail of a prefix goes
        # first, so the filler may come back short: what it answers is what can be found.
        filled = await client.put(filler, random_kv(layout, len(filler), seed=1))
        assert filled > 0 and (await client.lookup(filler)).num_tokens >= filled
        tokens = prefix + new
        kv = torch.cat([random_kv(layout, len(prefix)), random_kv(layout, len(new), seed=2)], dim=2)
        assert await client.put(tokens, kv, durable=True) == len(tokens)
        assert all("ssd" in server.core.where(k) for k in client.keys(tokens))
        hit = await client.lookup(tokens)
        assert hit.num_tokens == len(tokens)
        out = torch.zeros_like(kv)
        await client.get(hit, into=out)
        assert torch.equal(out, kv)
    assert server.core.view().idle


async def test_pages_held_by_an_allocation_are_released_by_abort_and_expiry(server_factory, tmp_path, layout, ns) -> None:
    """The pin an allocation takes on the pages it calls stored goes with the allocation:
    an aborted one and an expired one (a client that died mid-put) leave no pin."""
    from support.servers import make_config

    from kvstore.page import LayoutDesc

    server = server_factory(make_config(tmp_path, allocation_ttl_ms=100))
    core = server.core
    async with KVStoreClient(server.address, ns) as client:
        await client.put(list(range(32)), random_kv(layout, 32))
        keys = client.keys(list(range(48)))
    aborted, _ = core.allocate(ns.namespace_id, LayoutDesc.of(layout), keys)
    core.abort(aborted)
    assert core.view().idle and core.view().tiers["host"].num_pages == 2
    core.allocate(ns.namespace_id, LayoutDesc.of(layout), keys)
    assert core.view().pinned == set(keys[:2])
    await asyncio.sleep(0.2)  # past the allocation's ttl: nothing else ends it
    core.stats()  # any call reaps
    assert core.view().idle
    assert core.view().tiers["host"].used_bytes == 2 * layout.page_bytes
