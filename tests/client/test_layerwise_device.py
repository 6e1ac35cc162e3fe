"""Which copy path a layer-wise load takes is chosen by the device of the engine's KV: host
memory takes the worker-thread path (unchanged); the CUDA side stream is tested on a GPU
machine (tests_gpu/test_layerwise_cuda.py)."""

from __future__ import annotations

import torch
from conftest import random_kv

from kvstore.client import KVStoreClient
from kvstore.client.engine_kv import ContiguousKV, PagedKV
from kvstore.client.layerwise.device import HostLayers, kv_device, layer_signals


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
    assert isinstance(layer_signals(ContiguousKV(kv, layout), layout.num_layers), HostLayers)


async def test_a_load_into_host_memory_takes_the_host_path(server, layout, ns) -> None:
    tokens = list(range(64))
    kv = random_kv(layout, 64, seed=7)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        out = torch.zeros_like(kv)
        load = client.load(hit, into=out, ahead=1)
        assert isinstance(load._signals, HostLayers)  # read only
        assert all(load.wait(layer) for layer in range(layout.num_layers))
        assert await load.finished() == 64
        assert torch.equal(out, kv)
