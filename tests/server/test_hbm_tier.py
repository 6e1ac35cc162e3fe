"""`--tiers hbm,host,ssd` through the real server, with the hbm pool emulated in host memory
(`--hbm-device cpu`, the test-only switch): the placement core sees hbm as the top tier.
Pages an engine reads on its device (a layer-wise load through the device seam's CPU
implementation, ``on_device``) are promoted host -> hbm, a page held only in hbm is demoted
hbm -> host when hbm needs room, host pages go on down to ssd, and every read is bit-exact."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest
import torch
from support.kv import random_kv
from support.servers import ServerProcess, flip_arena_byte, make_config

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.bench.common.harness import KILL_WAIT_S
from kvstore.client import KVStoreClient
from kvstore.config import HbmTierConfig, ServerConfig
from kvstore.device_ops import CpuOps
from kvstore.errors import PageMissing
from kvstore.server import Server
from kvstore.tiers.base import Tier
from kvstore.tiers.faulty import FaultyTier

PAGE_TOKENS = 16  # SMALL layout: 32 KiB pages; a 1 MiB hbm pool holds 32 of them


def _config(tmp: Path, hbm_bytes: int = 1 << 20, host_bytes: int = 64 << 20) -> ServerConfig:
    base = make_config(tmp, host_bytes=host_bytes)
    return dataclasses.replace(base, tiers=("hbm", "host", "ssd"),
                               hbm=HbmTierConfig(capacity_bytes=hbm_bytes, slab_bytes=1 << 20, device="cpu"))


async def on_device(client: KVStoreClient, hit, kv: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Reads ``hit`` as an engine whose KV is on a device does (device placement asked)."""
    out = torch.zeros_like(kv)
    load = client.load(hit, into=out, ahead=1, deadline_s=30, device_ops=CpuOps())
    await load.finished()
    return out


def _tiers(server: Server, keys: list[bytes]) -> list[set[str]]:
    return [set(server.core.where(key)) for key in keys]


async def _remove_from(server: Server, ns, keys: list[bytes], tier: str) -> None:
    async with grpc.aio.insecure_channel(server.address) as ch:
        stub = directory_pb2_grpc.DirectoryStub(ch)
        await stub.Remove(directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=keys, tier=tier))


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "grpc"])
async def test_put_get_is_bit_exact_and_a_device_read_promotes_into_hbm(server_factory, tmp_path, layout, ns,
                                                                        use_shm) -> None:
    server = server_factory(_config(tmp_path))
    tokens = list(range(320))
    kv = random_kv(layout, 320, seed=11)
    async with KVStoreClient(server.address, ns, use_shm=use_shm) as client:
        assert await client.put(tokens, kv) == 320
        hit = await client.lookup(tokens)
        assert _tiers(server, hit.keys) == [{"host"}] * 20, "new pages land in the host arena"
        out = torch.zeros_like(kv)
        await client.get(hit, into=out)
        assert torch.equal(out, kv)
        assert _tiers(server, hit.keys) == [{"host"}] * 20, "a read into host memory copies nothing up"
        assert torch.equal(await on_device(client, hit, kv), kv)
        if not use_shm:  # streamed pages land in host buffers: no pool is mapped off the server's host
            assert _tiers(server, hit.keys) == [{"host"}] * 20
            return
        assert _tiers(server, hit.keys) == [{"host", "hbm"}] * 20, "a device read promotes host -> hbm"
        assert {loc.tier for loc in (await client.lookup(tokens)).locations} == {"hbm"}, "lookups name the fastest copy"
    stats = server.core.stats()
    assert stats.tiers["hbm"].num_pages == 20 and stats.counters["hbm"]["bytes_in"] == 20 * layout.page_bytes
    assert server.core.view().idle


async def test_hbm_demotes_to_host_host_to_ssd_and_reads_promote_back(server_factory, tmp_path, layout, ns) -> None:
    server = server_factory(_config(tmp_path))
    a_tokens, b_tokens = list(range(256)), list(range(10_000, 10_512))
    a_kv, b_kv = random_kv(layout, 256, seed=1), random_kv(layout, 512, seed=2)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(a_tokens, a_kv)
        a_hit = await client.lookup(a_tokens)
        await on_device(client, a_hit, a_kv)  # A: host + hbm
        await _remove_from(server, ns, a_hit.keys, "host")
        assert _tiers(server, a_hit.keys) == [{"hbm"}] * 16, "A is held in hbm only"

        # B fills the 32-page pool: A's pages are its victims and, held nowhere else, go down to host.
        await client.put(b_tokens, b_kv)
        await on_device(client, await client.lookup(b_tokens), b_kv)
        assert _tiers(server, a_hit.keys) == [{"host"}] * 16, "hbm -> host demotion"
        assert server.core.stats().tiers["hbm"].num_pages == 32

        # host -> ssd, as for any host page (here by removing the host copies after a durable write).
        await client.put(a_tokens, a_kv, durable=True)
        assert all("ssd" in t for t in _tiers(server, a_hit.keys))
        await _remove_from(server, ns, a_hit.keys, "host")
        assert _tiers(server, a_hit.keys) == [{"ssd"}] * 16

        # A device read promotes back up: ssd -> host (landing) -> hbm, bit-exact.
        assert torch.equal(await on_device(client, await client.lookup(a_tokens), a_kv), a_kv)
        assert _tiers(server, a_hit.keys) == [{"ssd", "host", "hbm"}] * 16
        out = torch.zeros_like(b_kv)
        await client.get(await client.lookup(b_tokens), into=out)  # B's pages left hbm for A's: read from host
        assert torch.equal(out, b_kv)
    assert server.core.view().idle


async def test_a_page_only_in_hbm_is_read_from_there(server_factory, tmp_path, layout, ns) -> None:
    server = server_factory(_config(tmp_path))
    tokens = list(range(160))
    kv = random_kv(layout, 160, seed=3)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        await on_device(client, hit, kv)
        await _remove_from(server, ns, hit.keys, "host")
        out = torch.zeros_like(kv)
        await client.get(await client.lookup(tokens), into=out)
        assert torch.equal(out, kv)
        assert _tiers(server, hit.keys) == [{"host", "hbm"}] * 10, "read into host from hbm, kept in both"
    assert server.core.stats().counters["hbm"]["evictions"] == 0


async def test_host_pressure_demotes_to_ssd_with_hbm_above(server_factory, tmp_path, layout, ns) -> None:
    """The demoter writes host pages down to ssd while hbm keeps copies of the hot ones."""
    server = server_factory(_config(tmp_path, host_bytes=4 << 20))  # 128 host pages
    tokens = list(range(16 * 200))
    kv = random_kv(layout, len(tokens), seed=4)
    async with KVStoreClient(server.address, ns) as client:
        head = tokens[: 16 * 8]
        await client.put(head, kv[:, :, : len(head)])
        await on_device(client, await client.lookup(head), kv[:, :, : len(head)])
        assert await client.put(tokens, kv) == len(tokens)
        hit = await client.lookup(tokens)
        assert hit.num_tokens == len(tokens)
        held = {tier for t in _tiers(server, hit.keys) for tier in t}
        assert {"ssd", "hbm"} <= held
        out = torch.zeros_like(kv)
        await client.get(hit, into=out)
        assert torch.equal(out, kv)
    assert server.core.view().idle


async def test_a_restart_keeps_ssd_pages_and_starts_with_an_empty_pool(server_factory, tmp_path, layout, ns) -> None:
    config = _config(tmp_path)
    server = server_factory(config)
    tokens = list(range(320))
    kv = random_kv(layout, 320, seed=5)
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv, durable=True) == 320
        await on_device(client, await client.lookup(tokens), kv)
        assert server.core.stats().tiers["hbm"].num_pages == 20
    server.stop(grace_s=1)
    again = server_factory(config)
    assert again.core.stats().tiers["hbm"].num_pages == 0, "device memory keeps nothing across a restart"
    async with KVStoreClient(again.address, ns) as client:
        hit = await client.lookup(tokens)
        assert hit.num_tokens == 320 and {loc.tier for loc in hit.locations} == {"ssd"}
        assert torch.equal(await on_device(client, hit, kv), kv)
        assert _tiers(again, hit.keys) == [{"ssd", "host", "hbm"}] * 20
    assert again.core.view().idle


async def test_a_faulty_hbm_pool_never_serves_a_wrong_byte_and_keeps_nothing_reserved(tmp_path, layout, ns) -> None:
    """Errors, short reads and corrupt copies in hbm (promotions, reads of hbm-only pages,
    demotions): every byte served is right, and at the end nothing is pinned or reserved."""
    def wrap(tier: Tier) -> Tier:
        return FaultyTier(tier, 7, error_rate=0.02, short_read_rate=0.2, corrupt_rate=0.1) if tier.name == "hbm" else tier

    server = Server(_config(tmp_path), wrap=wrap)
    server.start()
    try:
        async with KVStoreClient(server.address, ns) as client:
            for i in range(8):
                tokens = list(range(i * 100_000, i * 100_000 + 256))
                kv = random_kv(layout, 256, seed=20 + i)
                await client.put(tokens, kv)
                await on_device(client, await client.lookup(tokens), kv)
                hit = await client.lookup(tokens)
                await _remove_from(server, ns, hit.keys, "host")  # what is left lives in hbm only (or nowhere)
                out = torch.zeros_like(kv)
                hit = await client.lookup(tokens)
                try:
                    await client.get(hit, into=out)
                    served = hit.num_tokens
                except PageMissing as exc:
                    served = exc.num_tokens
                assert torch.equal(out[:, :, :served], kv[:, :, :served]), f"round {i}: a wrong byte was served"
                assert not out[:, :, served:].any(), f"round {i}: bytes past the valid prefix reached the caller"
        view = server.core.view()
        assert view.idle, view
        hbm = view.tiers["hbm"]
        assert hbm.used_bytes == hbm.num_pages * layout.page_bytes, "a reserved hbm slot was left behind"
    finally:
        server.stop(grace_s=1)


async def test_sigkill_with_hbm_keeps_ssd_pages_and_the_cli_flags_work(tmp_path, layout, ns) -> None:
    """kvstore-server --tiers hbm,host,ssd --hbm-device cpu, killed with SIGKILL after reads
    promoted pages into hbm: durable pages come back bit-exact, RAM-only ones are cleanly gone."""
    # no scrub: a page the scrubber checks is held as moving, and a read then leaves it in host (a CI run under load)
    proc = ServerProcess(tmp_path, "--tiers", "hbm,host,ssd", "--hbm-device", "cpu", "--hbm-capacity", "8MiB", "--scrub-rate", "0")
    durable, ram = list(range(320)), list(range(5000, 5320))
    kv = random_kv(layout, 320, seed=9)
    try:
        proc.start()
        async with KVStoreClient(proc.address, ns) as client:
            assert await client.put(durable, kv, durable=True) == 320
            assert await client.put(ram, kv) == 320
            for tokens in (durable, ram):  # the pool is the server process's, mapped here from the arena socket
                await on_device(client, await client.lookup(tokens), kv)
            assert {loc.tier for loc in (await client.lookup(durable)).locations} == {"hbm"}
        proc.kill()
        proc.start()
        async with KVStoreClient(proc.address, ns) as client:
            hit = await client.lookup(durable)
            assert hit.num_tokens == 320 and {loc.tier for loc in hit.locations} == {"ssd"}
            out = torch.zeros_like(kv)
            await client.get(hit, into=out)
            assert torch.equal(out, kv)
            assert (await client.lookup(ram)).num_tokens == 0
        assert proc.terminate() == 0
    finally:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait(KILL_WAIT_S)


async def test_a_page_a_promotion_finds_damaged_is_quarantined_not_only_skipped(server_factory, tmp_path, layout, ns) -> None:
    """Promotion copies each page up with its check (DESIGN §4): one scribbled on in the arena is
    not copied, and is dropped at once as any reader's find is, not left for the next reader."""
    server = server_factory(_config(tmp_path))
    tokens, kv = list(range(64)), random_kv(layout, 64, seed=12)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, kv)
        keys = (await client.lookup(tokens)).keys
    flip_arena_byte(server, server.core.where(keys[2])["host"] + 100)
    lease, pages = server.core.acquire(ns.namespace_id, keys, 10_000, device=True)
    try:
        assert len(pages) == 4
        assert [("hbm" in server.core.where(k)) for k in keys] == [True, True, False, True]
        assert keys[2] in [q.key for q in server.core.quarantined()], "the damaged page was skipped, not dropped"
        assert "host" not in server.core.where(keys[2])
    finally:
        server.core.release(lease)
    assert server.core.view().idle
