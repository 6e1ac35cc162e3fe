"""The real server with `--tiers hbm,host,ssd` on a CUDA device, and a layer-wise load into
KV on the GPU through the side stream. Needs lmdb (carried as a wheel: bench/gpu/README.md).
Synchronous tests running their own event loop: pytest-asyncio is not needed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from kvstore import KVLayout, Namespace
from kvstore.client import KVStoreClient
from kvstore.config import HbmTierConfig, HostTierConfig, ServerConfig, SsdTierConfig

LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_tokens=16)
NS = Namespace(model="gpu-checks", revision="r1", layout=LAYOUT)


def _kv(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, LAYOUT.kv_factor, tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=g).to(LAYOUT.torch_dtype())


def _server(tmp: Path, tiers: tuple[str, ...]):  # -> Server
    from kvstore.server import Server  # imports lmdb: a missing wheel fails these tests only

    config = ServerConfig(listen="127.0.0.1:0", data_dir=tmp / "data", tiers=tiers, metrics_listen=None,
                          host=HostTierConfig(capacity_bytes=256 << 20),
                          ssd=SsdTierConfig(directory=tmp / "ssd", capacity_bytes=512 << 20, dwpd=0, admission="all"),
                          hbm=HbmTierConfig(capacity_bytes=128 << 20, device="cuda"), scrub_pages_per_s=0.0)
    server = Server(config)
    server.start()
    return server


def test_server_with_hbm_on_cuda_put_get_bit_exact(tmp_path: Path) -> None:
    from kvstore.tiers.pinned import PinnedArena

    server = _server(tmp_path, ("hbm", "host", "ssd"))
    try:
        assert isinstance(server.core.landing, PinnedArena) and server.core.landing._pinned, "arena pinned for DMA"
        tokens = list(range(1024))
        kv = _kv(1024, seed=1)

        async def run() -> None:
            async with KVStoreClient(server.address, NS) as client:
                assert await client.put(tokens, kv) == 1024
                hit = await client.lookup(tokens)
                out = torch.zeros_like(kv)
                await client.get(hit, into=out)
                assert torch.equal(out, kv)
                assert all("hbm" in server.core.where(key) for key in hit.keys), "a read promotes into the GPU pool"
                out = torch.zeros_like(kv)
                await client.get(await client.lookup(tokens), into=out)
                assert torch.equal(out, kv)

        asyncio.run(run())
        assert server.core.view().idle
    finally:
        server.stop(grace_s=1)


def test_layerwise_load_into_cuda_kv_on_a_side_stream(tmp_path: Path, figures) -> None:
    from kvstore.client.layerwise.device import CudaLayers

    server = _server(tmp_path, ("host", "ssd"))
    try:
        tokens = list(range(2048))
        kv = _kv(2048, seed=2)

        async def run() -> None:
            async with KVStoreClient(server.address, NS) as client:
                await client.put(tokens, kv)
                hit = await client.lookup(tokens)
                out = torch.zeros(kv.shape, dtype=kv.dtype, device="cuda")
                checks = torch.zeros(LAYOUT.num_layers, device="cuda")
                load = client.load(hit, into=out, ahead=2, deadline_s=60)
                assert isinstance(load._signals, CudaLayers)
                for layer in range(LAYOUT.num_layers):
                    assert load.wait(layer)
                    checks[layer] = out[layer].float().abs().sum()  # engine work ordered after the layer's copies
                assert await load.finished() == 2048
                torch.cuda.synchronize()
                assert torch.equal(out.cpu(), kv)
                expected = kv.float().abs().sum(dim=(1, 2, 3, 4))
                assert torch.allclose(checks.cpu(), expected, rtol=1e-3), "a layer was read before its copy landed"
                figures["layerwise_load_bytes"] = hit.num_pages * LAYOUT.page_bytes

        asyncio.run(run())
    finally:
        server.stop(grace_s=1)
