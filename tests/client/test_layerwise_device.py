"""Which copy path a layer-wise load takes is chosen by the device of the engine's KV: host
memory takes the worker-thread path; KV on a device takes the side stream with one event
per layer, here run with the CPU implementation of the device seam (``CpuOps``): the same
lines as on a GPU but the CUDA calls, which tests_gpu/test_server_cuda.py runs. Such a load
asks for device placement: from a server with hbm its pages come out of the client's pool."""

from __future__ import annotations

import dataclasses

import torch
from support.kv import random_kv
from support.servers import make_config

from kvstore.client import KVStoreClient
from kvstore.client.engine_kv import ContiguousKV, PagedKV
from kvstore.client.layerwise.device import HostLayers, StreamLayers, kv_device, layer_signals
from kvstore.config import HbmTierConfig
from kvstore.device_ops import CpuOps


class _Opaque:
    """An EngineKV whose tensors the loader cannot see."""

    num_tokens = 16

    def read_layer(self, page: int, layer: int) -> torch.Tensor:
        raise AssertionError("choosing a path must not read the engine's KV")

    def write_layer(self, page: int, layer: int, src: torch.Tensor) -> None:
        raise AssertionError("not written here")


def test_the_device_is_read_off_the_tensors_the_engine_kv_wraps(layout) -> None:
    kv = random_kv(layout, 32)
    paged = PagedKV([torch.zeros(2, layout.kv_factor, 16, layout.num_kv_heads, layout.head_dim, dtype=layout.torch_dtype())
                     for _ in range(layout.num_layers)], [0, 1], 32, layout)
    assert kv_device(ContiguousKV(kv, layout)) == torch.device("cpu")
    assert kv_device(paged) == torch.device("cpu")
    assert kv_device(_Opaque()) == torch.device("cpu"), "an unknown kind takes the synchronous host path"
    assert isinstance(layer_signals(None, layout.num_layers), HostLayers)
    assert isinstance(layer_signals(CpuOps(), layout.num_layers), StreamLayers)


async def test_a_load_into_host_memory_takes_the_host_path(server, layout, ns) -> None:
    tokens = list(range(64))
    kv = random_kv(layout, 64, seed=7)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        out = torch.zeros_like(kv)
        load = client.load(hit, into=out, ahead=1, deadline_s=30)  # the default 50 ms is short on a loaded machine
        assert isinstance(load._signals, HostLayers)  # read only
        assert all(load.wait(layer) for layer in range(layout.num_layers))
        assert await load.finished() == 64
        assert torch.equal(out, kv)


async def _device_load(address: str, layout, ns, seed: int) -> tuple[CpuOps, object]:
    tokens = list(range(1000 * seed, 1000 * seed + 64))
    kv = random_kv(layout, 64, seed=seed)
    ops = CpuOps()
    async with KVStoreClient(address, ns) as client:
        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        out = torch.zeros_like(kv)
        load = client.load(hit, into=out, ahead=1, deadline_s=30, device_ops=ops)
        assert isinstance(load._signals, StreamLayers)
        assert all(load.wait(layer) for layer in range(layout.num_layers))
        assert await load.finished() == 64
        assert torch.equal(out, kv), "bit-exact through the device path"
        staged = load._staged
    assert ops.num_recorded == layout.num_layers, "one event per layer, recorded on the side stream"
    assert ops.num_waited == layout.num_layers, "the engine's stream waited on each layer's event"
    return ops, staged


async def test_a_load_into_device_kv_takes_the_side_stream_and_reads_from_the_arena(server, layout, ns) -> None:
    """No hbm on the server: the device path copies from the (page-locked) arena."""
    _, staged = await _device_load(server.address, layout, ns, seed=3)
    assert staged.pool is None and staged.on_device == [False] * 4  # type: ignore[attr-defined]


async def test_a_load_into_device_kv_reads_its_pages_from_the_clients_hbm_pool(server_factory, tmp_path, layout,
                                                                             ns) -> None:
    """With hbm the load asks for device placement: the server copies the pages into the
    pool this client mapped from the arena socket, and the load copies them from there."""
    server = server_factory(dataclasses.replace(make_config(tmp_path), tiers=("hbm", "host", "ssd"),
                                                hbm=HbmTierConfig(capacity_bytes=4 << 20, slab_bytes=1 << 20,
                                                                  device="cpu")))
    _, staged = await _device_load(server.address, layout, ns, seed=4)
    assert staged.pool is not None and staged.on_device == [True] * 4  # type: ignore[attr-defined]
    assert server.core.stats().counters["hbm"]["bytes_in"] == 4 * layout.page_bytes
