"""Layer-wise loads and saves that end badly: closed mid-save, failed, past their deadline,
outliving their lease, or copying a slot that changed under them. Each checks that nothing
wrong is reported valid and nothing is left behind."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable

import grpc
import pytest
import torch
from support.kv import random_kv
from support.servers import make_config

from kvstore import KVLayout
from kvstore._proto import data_pb2, data_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.client.engine_kv import ContiguousKV
from kvstore.config import HostTierConfig
from kvstore.errors import KVStoreError
from kvstore.page import LayoutDesc
from kvstore.validate import layout_msg


class SlowKV:
    """The engine's KV behind a busy device: every layer write takes ``write_s`` and is
    logged as (page, layer, start time); ``before_write`` runs first (the engine's side)."""

    def __init__(self, kv: torch.Tensor, layout: KVLayout, write_s: float,
                 before_write: Callable[[int, int], None] | None = None) -> None:
        self.inner = ContiguousKV(kv, layout)
        self.num_tokens = kv.shape[2]
        self.write_s = write_s
        self.before_write = before_write
        self.writes: list[tuple[int, int, float]] = []

    def read_layer(self, page: int, layer: int) -> torch.Tensor:
        return self.inner.read_layer(page, layer)

    def write_layer(self, page: int, layer: int, src: torch.Tensor) -> None:
        self.writes.append((page, layer, time.monotonic()))
        if self.before_write is not None:
            self.before_write(page, layer)
        time.sleep(self.write_s)  # the device is busy: this is the work, not a wait for an event
        self.inner.write_layer(page, layer, src)


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "grpc"])
async def test_closing_the_client_mid_save_publishes_nothing(server, layout, ns, use_shm) -> None:
    """Regression: closing the client during a layer-wise save marked every layer done,
    so 64 tokens were published with layers 1..N never computed (zeros, checksum-clean)."""
    tokens = list(range(64))
    kv = torch.zeros(layout.num_layers, layout.kv_factor, 64, layout.num_kv_heads, layout.head_dim, dtype=layout.torch_dtype())
    kv[0] = random_kv(layout, 64, seed=31)[0]  # the engine computed layer 0 only
    before = server.core.view().tiers["host"]
    client = KVStoreClient(server.address, ns, use_shm=use_shm)
    await client.connect()
    save = client.save(tokens, kv)
    save.layer_done(0)
    await client.close()
    async with KVStoreClient(server.address, ns) as reader:
        assert (await reader.lookup(tokens)).num_tokens == 0, "layers the engine never computed were published"
    assert server.core.view().tiers["host"] == before, "the abandoned save left slots allocated"
    with pytest.raises(KVStoreError, match="abandoned"):
        await save.finished()


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "grpc"])
async def test_a_failed_layerwise_load_reports_nothing_loaded(server, layout, ns, use_shm) -> None:
    """Regression: when the lease RPC failed, wait(0) was False but finished() returned
    hit.num_tokens (160) instead of the tokens delivered (0). (Over gRPC the refused stream
    was taken for an empty hit: wait(0) was True.)"""
    tokens = list(range(160))
    kv = random_kv(layout, 160, seed=32)
    async with KVStoreClient(server.address, ns) as writer:
        await writer.put(tokens, kv)
    too_long = server.config.max_lease_ms + 1  # the server refuses the Acquire
    async with KVStoreClient(server.address, ns, lease_ms=too_long, use_shm=use_shm) as client:
        assert client.shared_memory == use_shm
        hit = await client.lookup(tokens)
        assert hit.num_tokens == 160
        load = client.load(hit, into=torch.zeros_like(kv), deadline_s=30)
        assert load.wait(0) is False
        assert await load.finished() == 0
        assert load.num_tokens == 0


async def test_the_load_worker_stops_at_the_deadline_by_itself(server, layout, ns) -> None:
    """Regression: the deadline was enforced only inside wait(); an engine busy in its
    own compute got its KV written long after the load was given up (the review counted
    17 of 40 layer writes after the deadline)."""
    tokens = list(range(160))  # 10 pages x 4 layers = 40 layer writes of 20 ms
    kv = random_kv(layout, 160, seed=33)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        into = torch.zeros_like(kv)
        engine = SlowKV(into, layout, write_s=0.02)
        load = client.load(hit, into=engine, deadline_s=0.2)
        load.join(10)  # the engine computes and never calls wait(): the worker must stop on its own
        late = [w for w in engine.writes if w[2] >= load.deadline]
        assert not late, f"{len(late)} of {len(engine.writes)} layer writes started after the deadline"
        # paced by the slowest write so far, the last one started one write's time before the deadline
        assert engine.writes[-1][2] + engine.write_s <= load.deadline + engine.write_s / 2
        assert len(engine.writes) < 40
        for page in range(10):  # only what the log shows was written before the deadline
            for layer in range(layout.num_layers):
                region = into[layer, :, page * 16 : (page + 1) * 16]
                assert bool(region.any()) == any(w[:2] == (page, layer) for w in engine.writes)
        assert load.wait(layout.num_layers - 1) is False
        assert load.num_tokens == 0 and await load.finished() == 0
        assert not server.core.view().pinned, "the abandoned load left pages leased"


async def test_closing_the_client_mid_load_leaves_nothing_leased(server, layout, ns) -> None:
    """Closing the client while the worker copies (and its leases are kept alive) stops the
    load: nothing more is written, nothing stays pinned, nothing is reported loaded."""
    tokens = list(range(160))
    kv = random_kv(layout, 160, seed=38)
    client = KVStoreClient(server.address, ns, lease_ms=300)  # renewed every 100 ms meanwhile
    await client.connect()
    await client.put(tokens, kv)
    hit = await client.lookup(tokens)
    engine = SlowKV(torch.zeros_like(kv), layout, write_s=0.02)
    load = client.load(hit, into=engine, deadline_s=30)
    assert await asyncio.get_running_loop().run_in_executor(None, load.wait, 0)
    await client.close()
    written = len(engine.writes)
    assert written < 40 and not server.core.view().pinned
    assert await load.finished() == 0 and load.wait(layout.num_layers - 1) is False
    assert len(engine.writes) == written


def _small_lru_server(server_factory, tmp_path):  # type: ignore[no-untyped-def]
    """A 4 MiB host tier (128 pages of the small layout) evicting least recently used first."""
    config = make_config(tmp_path)
    return server_factory(dataclasses.replace(config, host=HostTierConfig(capacity_bytes=4 << 20, eviction="lru")))


async def test_a_long_load_keeps_its_lease(server_factory, tmp_path, layout, ns) -> None:
    """Regression: a layer-wise load checked each slot once, then copied it layer by
    layer without renewing its lease; a load outliving the lease copied slots that had been
    evicted and reused meanwhile, and reported the wrong KV as valid."""
    server = _small_lru_server(server_factory, tmp_path)
    tokens = list(range(128))
    kv = random_kv(layout, 128, seed=34)
    reached, resume = threading.Event(), threading.Event()

    def engine_side(page: int, layer: int) -> None:
        if (page, layer) == (0, 1):  # layer 0 is in place; the engine is slow with the rest
            reached.set()
            resume.wait(30)

    lease_ms = 1500  # renewed every 500 ms: a second of slack on a loaded 2-core host
    async with KVStoreClient(server.address, ns, lease_ms=lease_ms) as client, KVStoreClient(server.address, ns) as other:
        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        into = torch.zeros_like(kv)
        load = client.load(hit, into=SlowKV(into, layout, write_s=0.0, before_write=engine_side), deadline_s=60)
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, reached.wait, 30)
        await asyncio.sleep(2.5 * lease_ms / 1000)  # the lease would have expired by now
        flood = list(range(10_000, 10_000 + 256 * 16))  # twice the host tier: evicts everything not pinned
        await other.put(flood, random_kv(layout, len(flood), seed=35))
        resume.set()
        assert all(load.wait(layer) for layer in range(layout.num_layers))
        assert await load.finished() == 128
        assert torch.equal(into, kv), "the load copied slots reused by other pages"


async def test_a_lease_lost_under_the_load_is_not_reported_valid(server_factory, tmp_path, layout, ns) -> None:
    """Regression: when a load's lease went (here another caller releases it), its
    slots were evicted and reused while the load kept copying them, and the other pages'
    bytes were reported as this hit's KV. The refused renewal (or the check of what was
    copied) must abandon it."""
    server = _small_lru_server(server_factory, tmp_path)
    tokens = list(range(128))
    kv = random_kv(layout, 128, seed=39)
    flood = list(range(10_000, 10_000 + 256 * 16))
    flood_kv = random_kv(layout, len(flood), seed=40)
    loop = asyncio.get_running_loop()
    async with KVStoreClient(server.address, ns, lease_ms=300) as client, KVStoreClient(server.address, ns) as other:

        def engine_side(page: int, layer: int) -> None:
            if (page, layer) == (0, 1):
                with grpc.insecure_channel(server.address) as channel:
                    for lease_id in server.core.view().lease_ids:  # read, to aim the release
                        data_pb2_grpc.DataStub(channel).Release(data_pb2.ReleaseRequest(lease_id=lease_id), timeout=10)
                asyncio.run_coroutine_threadsafe(other.put(flood, flood_kv), loop).result(60)

        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        into = torch.zeros_like(kv)
        load = client.load(hit, into=SlowKV(into, layout, write_s=0.0, before_write=engine_side), deadline_s=60)
        await loop.run_in_executor(None, load.join, 60)
        assert load.wait(layout.num_layers - 1) is False
        assert await load.finished() == 0 and load.num_tokens == 0
        assert not server.core.view().pinned


async def test_a_slot_changed_under_the_load_is_not_reported_valid(server, layout, ns) -> None:
    """Regression: what a layer-wise load copied was never verified, so a slot whose
    bytes changed after the first check (reused, overwritten) reached the engine as valid
    KV. Here page 5's last layer changes after the check; the load keeps pages 0-4 only."""
    tokens = list(range(128))
    kv = random_kv(layout, 128, seed=36)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        assert client.arena is not None
        offset = server.core.where(hit.keys[5])["host"]  # read, to aim the fault
        last_layer = (layout.num_layers - 1) * layout.page_bytes // layout.num_layers

        def overwrite_page_5(page: int, layer: int) -> None:
            if (page, layer) == (0, 1):  # checked and leased, layer 0 in place
                client.arena.array[offset + last_layer : offset + layout.page_bytes] ^= 0xFF  # type: ignore[union-attr]

        into = torch.zeros_like(kv)
        load = client.load(hit, into=SlowKV(into, layout, write_s=0.0, before_write=overwrite_page_5), deadline_s=30)
        assert all(load.wait(layer) for layer in range(layout.num_layers - 1))
        assert load.wait(layout.num_layers - 1) is False, "the last wait must say that what was computed on is not all valid"
        assert load.num_tokens == 80
        assert await load.finished() == 80
        assert torch.equal(into[:, :, :80], kv[:, :, :80])


async def test_renew_extends_a_lease_and_refuses_a_gone_one(server, layout, ns) -> None:
    """Renew keeps a lease past its first ttl; a released lease or an out-of-range ttl is
    refused with a clear status and changes nothing."""
    tokens = list(range(32))
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, random_kv(layout, 32, seed=37))
        keys = client.keys(tokens)
    with grpc.insecure_channel(server.address) as channel:
        data = data_pb2_grpc.DataStub(channel)
        acq = data.Acquire(data_pb2.AcquireRequest(namespace_id=ns.namespace_id, keys=keys, ttl_ms=200), timeout=10)
        assert len(acq.pages) == 2
        entries = server.core.view().num_expiry_entries
        for _ in range(1000):  # a caller renewing in a loop grows nothing
            data.Renew(data_pb2.RenewRequest(lease_id=acq.lease_id, ttl_ms=5000), timeout=10)
        assert server.core.view().num_expiry_entries == entries
        await asyncio.sleep(0.4)  # past the first ttl
        server.core.stats()  # reaps what has expired
        assert server.core.view().pinned == set(keys), "a renewed lease expired at its first ttl"
        with pytest.raises(grpc.RpcError) as err:
            data.Renew(data_pb2.RenewRequest(lease_id=acq.lease_id, ttl_ms=server.config.max_lease_ms + 1), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        data.Release(data_pb2.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
        assert not server.core.view().pinned
        with pytest.raises(grpc.RpcError) as err:
            data.Renew(data_pb2.RenewRequest(lease_id=acq.lease_id, ttl_ms=5000), timeout=10)
        assert err.value.code() == grpc.StatusCode.ABORTED and "released or has expired" in (err.value.details() or "")
        assert not server.core.view().pinned, "renewing a gone lease pinned something"


async def test_a_save_slower_than_its_allocation_never_writes_into_other_pages(server_factory, tmp_path, layout, ns) -> None:
    """Bug: a layer-wise save allocates its arena slots at once and copies each layer as the
    engine marks it done, but nothing keeps the allocation alive: when the engine takes
    longer than the allocation's ttl (60 s by default; a long prefill), the allocation
    expires, its slots are given to other writers, and the save's worker then copies the
    remaining layers over their committed pages (here every page of the other client then
    fails its checksum: PageCorrupt, its KV lost). Seen failing before allocations could be
    renewed: PageCorrupt on the other client's get. Now the save renews its slots every third
    of their term; both saves are whole."""
    server = server_factory(make_config(tmp_path, host_bytes=4 << 20, ssd_bytes=None, allocation_ttl_ms=1500))
    tokens = list(range(64))
    others = list(range(10**6, 10**6 + 16 * 124))  # the rest of the host tier: expired slots would be reused
    other_kv = random_kv(layout, len(others), seed=2)
    async with KVStoreClient(server.address, ns) as saver, KVStoreClient(server.address, ns) as other:
        kv = random_kv(layout, 64, seed=1)
        save = saver.save(tokens, kv)
        save.layer_done(0)
        await asyncio.sleep(3.5)  # the engine computes layer 1 for longer than two allocation terms
        assert await other.put(others, other_kv) == len(others)
        for layer in range(1, layout.num_layers):
            save.layer_done(layer)
        assert await save.finished() == 64  # its slots were renewed while the engine computed
        out = torch.zeros_like(other_kv)
        await other.get(await other.lookup(others), into=out)
        assert torch.equal(out, other_kv)
        mine = torch.zeros_like(kv)
        assert await saver.get(await saver.lookup(tokens), into=mine) == 64
        assert torch.equal(mine, kv)


async def test_renew_keeps_an_allocation_and_refuses_a_committed_one(server_factory, tmp_path, layout, ns) -> None:
    """Renew with an allocation's handle keeps its slots past the allocation's term (what a
    slow layer-wise save needs); the term is in AllocateResponse.ttl_ms; a committed
    allocation is ABORTED and changes nothing; an over-long ttl is INVALID_ARGUMENT."""
    server = server_factory(make_config(tmp_path, ssd_bytes=None, allocation_ttl_ms=1500))
    with grpc.insecure_channel(server.address) as channel:
        data = data_pb2_grpc.DataStub(channel)
        page_keys = [bytes([i]) * 16 for i in range(3)]
        alloc = data.Allocate(data_pb2.AllocateRequest(namespace_id=ns.namespace_id, layout=layout_msg(LayoutDesc.of(layout)),
                                                       keys=page_keys), timeout=10)
        assert alloc.ttl_ms == 1500 and len(alloc.slots) == 3
        for _ in range(10):  # 3 s: two terms, each renewal 1.2 s before the term's end (a slow host's slack)
            data.Renew(data_pb2.RenewRequest(lease_id=alloc.allocation_id), timeout=10)
            await asyncio.sleep(0.3)
            server.core.stats()  # reaps what has expired
        assert server.core.view().num_allocations == 1, "a renewed allocation expired at its first term"
        with pytest.raises(grpc.RpcError) as err:
            data.Renew(data_pb2.RenewRequest(lease_id=alloc.allocation_id, ttl_ms=10**9), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        data.Abort(data_pb2.AbortRequest(allocation_id=alloc.allocation_id), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            data.Renew(data_pb2.RenewRequest(lease_id=alloc.allocation_id), timeout=10)
        assert err.value.code() == grpc.StatusCode.ABORTED
        view = server.core.view()
        assert view.num_allocations == 0 and not view.pinned
