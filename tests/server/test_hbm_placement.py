"""What reaches the hbm pool (DESIGN §6): only pages an engine asked to read on its
device (AcquireRequest.device), never every Acquire. Real server, the pool emulated in
host memory (`--hbm-device cpu`), the engine's mapping of its pool received through the
arena socket as an engine receives it."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import torch
from support.kv import random_kv
from support.servers import ServerProcess, make_config

from kvstore.bench.common.harness import KILL_WAIT_S
from kvstore.client import KVStoreClient
from kvstore.config import HbmTierConfig, ServerConfig
from kvstore.device_ops import CpuOps
from kvstore.errors import KVStoreError
from kvstore.server import Server


def _config(tmp: Path) -> ServerConfig:
    return dataclasses.replace(make_config(tmp), tiers=("hbm", "host", "ssd"),
                               hbm=HbmTierConfig(capacity_bytes=4 << 20, slab_bytes=1 << 20, device="cpu"))


def _in_hbm(server: Server, keys: list[bytes]) -> int:
    return sum("hbm" in server.core.where(key) for key in keys)


async def test_an_acquire_without_device_placement_copies_nothing_into_the_pool(server_factory, tmp_path, layout,
                                                                               ns) -> None:
    """Bug (found in review): every Acquire copied its pages host -> hbm, into a pool no
    client read. A get, a layer-wise load into host memory and ReadPages ask for no device
    placement: the pool stays empty."""
    server = server_factory(_config(tmp_path))
    tokens = list(range(160))
    kv = random_kv(layout, 160, seed=1)
    for use_shm in (True, False):
        async with KVStoreClient(server.address, ns, use_shm=use_shm) as client:
            await client.put(tokens, kv)
            hit = await client.lookup(tokens)
            out = torch.zeros_like(kv)
            await client.get(hit, into=out)
            assert torch.equal(out, kv)
            load = client.load(hit, into=torch.zeros_like(kv), ahead=1, deadline_s=30)
            assert await load.finished() == 160
            assert _in_hbm(server, hit.keys) == 0, f"use_shm={use_shm}: a read without device placement filled the pool"
    assert server.core.stats().counters["hbm"]["bytes_in"] == 0


async def test_after_a_restart_a_device_load_maps_the_new_pool(tmp_path, layout, ns) -> None:
    """A restarted server makes a new pool (another token): the client's next device loads
    map it, instead of reading through the arena while the server fills a pool nobody maps."""
    proc = ServerProcess(tmp_path, "--tiers", "hbm,host,ssd", "--hbm-device", "cpu", "--hbm-capacity", "8MiB")
    tokens = list(range(160))
    kv = random_kv(layout, 160, seed=2)
    try:
        proc.start()
        async with KVStoreClient(proc.address, ns) as client:
            for restart in (False, True):
                if restart:
                    proc.kill()
                    proc.start()
                for attempt in range(50):  # the first calls after the restart may find the server not serving yet
                    try:
                        await client.put(tokens, kv)
                        load = client.load(await client.lookup(tokens), into=torch.zeros_like(kv), ahead=1,
                                           deadline_s=30, device_ops=CpuOps())
                        if await load.finished() == 160 and all(load._staged.on_device):  # type: ignore[attr-defined]
                            break
                    except KVStoreError:
                        pass
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError(f"restart={restart}: device loads never read from the server's pool")
        assert proc.terminate() == 0
    finally:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait(KILL_WAIT_S)
