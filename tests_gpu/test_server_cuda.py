"""The real server with `--tiers hbm,host,ssd` on a CUDA device, and layer-wise loads into KV
on the GPU through the side stream: the lines the CPU suite runs with CpuOps, here with
CudaOps (DESIGN §6). Needs lmdb (carried as a wheel: bench/gpu/README.md).
Synchronous tests running their own event loop: pytest-asyncio is not needed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import torch

from kvstore import KVLayout, Namespace
from kvstore.client import KVStoreClient
from kvstore.config import HbmTierConfig, HostTierConfig, SecurityConfig, ServerConfig, SsdTierConfig
from kvstore.device_cuda import CudaOps

LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_tokens=16)
NS = Namespace(model="gpu-checks", revision="r1", layout=LAYOUT)
A, B = "gpu-tenant-a-token-0123456789ab", "gpu-tenant-b-token-0123456789ab"


def _kv(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, LAYOUT.kv_factor, tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=g).to(LAYOUT.torch_dtype())


def _server(tmp: Path, tiers: tuple[str, ...], tenants: bool = False):  # -> Server
    from kvstore.server import Server  # imports lmdb: a missing wheel fails these tests only

    security = SecurityConfig()
    if tenants:  # tokens in clear to a loopback port this uid owns (no TLS, so no cryptography needed)
        auth = tmp / "auth.json"
        auth.write_text(json.dumps({"tokens": [{"tenant": "a", "rights": ["read", "write"], "token": A},
                                               {"tenant": "b", "rights": ["read", "write"], "token": B}]}))
        auth.chmod(0o600)
        security = SecurityConfig(auth_file=auth)
    config = ServerConfig(listen="127.0.0.1:0", data_dir=tmp / "data", tiers=tiers, metrics_listen=None,
                          host=HostTierConfig(capacity_bytes=256 << 20), security=security,
                          ssd=SsdTierConfig(directory=tmp / "ssd", capacity_bytes=512 << 20, dwpd=0, admission="all"),
                          hbm=HbmTierConfig(capacity_bytes=128 << 20, device="cuda"), scrub_pages_per_s=0.0)
    server = Server(config)
    server.start()
    return server


def _arenas_pinned(server: Any) -> None:
    """Every arena is registered through CudaOps and counts as pinned memory to CUDA."""
    pins = server.core.landing.pins
    assert isinstance(pins.ops, CudaOps)
    for part in server.core.landing.parts():
        assert torch.frombuffer(part.memory(), dtype=torch.uint8).is_pinned(), "arena not page-locked"


async def _device_load(client: KVStoreClient, tokens: list[int], kv: torch.Tensor, figures: dict[str, Any] | None,
                       ) -> Any:
    """Loads ``tokens`` into KV on the GPU layer by layer, doing engine work on each layer
    right after ``wait(layer)``; checks bit-exactness and that no layer was read early."""
    hit = await client.lookup(tokens)
    out = torch.zeros(kv.shape, dtype=kv.dtype, device="cuda")
    checks = torch.zeros(LAYOUT.num_layers, device="cuda")
    load = client.load(hit, into=out, ahead=2, deadline_s=60)
    assert isinstance(load.ops, CudaOps), "KV on CUDA takes the device path"
    for layer in range(LAYOUT.num_layers):
        assert load.wait(layer)
        checks[layer] = out[layer].float().abs().sum()  # engine work ordered after the layer's copies
    assert await load.finished() == len(tokens)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), kv)
    expected = kv.float().abs().sum(dim=(1, 2, 3, 4))
    assert torch.allclose(checks.cpu(), expected, rtol=1e-3), "a layer was read before its copy landed"
    if figures is not None:
        figures["layerwise_load_bytes"] = hit.num_pages * LAYOUT.page_bytes
    return load


def test_layerwise_load_into_cuda_kv_reads_from_the_clients_pool(tmp_path: Path, figures) -> None:
    server = _server(tmp_path, ("hbm", "host", "ssd"))
    try:
        _arenas_pinned(server)
        tokens = list(range(1024))
        kv = _kv(1024, seed=1)

        async def run() -> None:
            async with KVStoreClient(server.address, NS) as client:
                assert await client.put(tokens, kv) == 1024
                out = torch.zeros_like(kv)
                await client.get(await client.lookup(tokens), into=out)
                assert torch.equal(out, kv)
                assert server.core.stats().counters["hbm"]["bytes_in"] == 0, "a read into host memory copies nothing up"
                load = await _device_load(client, tokens, kv, figures)
                assert load._staged.pool is not None and all(load._staged.on_device), "read from the CUDA pool"
                hit = await client.lookup(tokens)
                assert all("hbm" in server.core.where(key) for key in hit.keys)

        asyncio.run(run())
        assert server.core.view().idle
    finally:
        server.stop(grace_s=1)


def test_layerwise_load_into_cuda_kv_from_the_arena_on_a_side_stream(tmp_path: Path) -> None:
    """No hbm: the side stream copies from the (page-locked) arena."""
    server = _server(tmp_path, ("host", "ssd"))
    try:
        tokens = list(range(2048))
        kv = _kv(2048, seed=2)

        async def run() -> None:
            async with KVStoreClient(server.address, NS) as client:
                await client.put(tokens, kv)
                load = await _device_load(client, tokens, kv, None)
                assert load._staged.pool is None and not any(load._staged.on_device)

        asyncio.run(run())
    finally:
        server.stop(grace_s=1)


def test_tenants_pools_and_arenas_on_cuda(tmp_path: Path) -> None:
    """Each tenant's engine maps its own pool (another IPC handle) and reads its pages from it;
    every tenant arena, made after start, is page-locked."""
    server = _server(tmp_path, ("hbm", "host", "ssd"), tenants=True)
    try:
        tokens = list(range(512))
        kvs = {A: _kv(512, seed=3), B: _kv(512, seed=4)}

        async def run() -> dict[str, bytes]:
            tokens_seen = {}
            for token, kv in kvs.items():
                async with KVStoreClient(server.address, NS, token=token) as client:
                    await client.put(tokens, kv)
                    load = await _device_load(client, tokens, kv, None)
                    assert load._staged.pool is not None and all(load._staged.on_device)
                    tokens_seen[token] = load._staged.pool.token
            return tokens_seen

        seen = asyncio.run(run())
        assert seen[A] == server.core.pool_of("a").token and seen[B] == server.core.pool_of("b").token
        assert seen[A] != seen[B], "one pool per tenant"
        _arenas_pinned(server)
    finally:
        server.stop(grace_s=1)


def test_vllms_gpu_kv_layout_loads_through_the_device_path(tmp_path: Path) -> None:
    """vLLM's flash-attention layout ([2, blocks, block_size, heads, dim] per layer, on the GPU)
    through the connector's own block views (client/adapters/vllm/layout.py, no vLLM import)."""
    from kvstore.client.adapters.vllm.layout import RequestKV, block_views

    server = _server(tmp_path, ("hbm", "host", "ssd"))
    try:
        tokens = list(range(4 * LAYOUT.page_tokens))
        kv = _kv(len(tokens), seed=5)
        block = LAYOUT.page_tokens
        caches = [torch.zeros(2, 8, block, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype=kv.dtype, device="cuda")
                  for _ in range(LAYOUT.num_layers)]
        blocks, together = block_views(caches, block, LAYOUT.num_kv_heads, LAYOUT.head_dim)

        async def run() -> None:
            async with KVStoreClient(server.address, NS) as client:
                await client.put(tokens, kv)
                hit = await client.lookup(tokens)
                into = RequestKV(blocks, [3, 4, 5, 6], 0, 4, LAYOUT, all_layers=together)
                load = client.load(hit, into=into, ahead=1, deadline_s=60)
                assert isinstance(load.ops, CudaOps)
                assert all(load.wait(layer) for layer in range(LAYOUT.num_layers))
                assert await load.finished() == len(tokens)
                assert all(load._staged.on_device)

        asyncio.run(run())
        torch.cuda.synchronize()
        for layer in range(LAYOUT.num_layers):
            for page in range(4):
                got = caches[layer][:, 3 + page].cpu()  # [2, block, heads, dim]
                assert torch.equal(got, kv[layer, :, page * block : (page + 1) * block]), f"layer {layer} page {page}"
    finally:
        server.stop(grace_s=1)
