"""The acceptance example (tests/test_acceptance.py) as a check a benchmark runs against its
server after abusing it: put, lookup, get bit-exact, a new revision finds nothing, and a
layer-wise save then a layer-wise load, bit-exact; through the shared arena and over gRPC."""

from __future__ import annotations

import uuid

import torch

from kvstore import KVLayout, Namespace
from kvstore.client import KVStoreClient
from kvstore.security.channel import ClientTLS

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact (float compare would call NaN patterns unequal and -0.0 equal to 0.0)."""
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


async def _example(addr: str, token: str | None, tls: ClientTLS | None, use_shm: bool) -> list[str]:
    failed: list[str] = []
    revision = f"accept-{uuid.uuid4().hex[:8]}"  # fresh pages: nothing the abuse before left behind counts
    ns = Namespace(model="demo", revision=revision, layout=LAYOUT)
    tokens = list(range(1000))
    kv = torch.randn(LAYOUT.num_layers, 2, len(tokens), LAYOUT.num_kv_heads, LAYOUT.head_dim).to(LAYOUT.dtype)
    async with KVStoreClient(addr, ns, use_shm=use_shm, token=token, tls=tls) as client:
        if use_shm and not client.shared_memory:
            failed.append("the client could not map the arena")
        if (stored := await client.put(tokens, kv)) != 992:
            failed.append(f"put stored {stored} tokens, expected 992")
        hit = await client.lookup(tokens + [7, 8, 9])
        if hit.num_tokens != 992:
            failed.append(f"lookup found {hit.num_tokens} tokens, expected 992")
        out = torch.empty(LAYOUT.num_layers, 2, hit.num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype=LAYOUT.dtype)
        await client.get(hit, into=out)
        if not _same(out, kv[:, :, : hit.num_tokens]):
            failed.append("get returned other bytes than were put")
        # layer-wise: save a second sequence layer by layer, then load it layer by layer
        tokens2 = [t + 5000 for t in tokens]
        kv2 = torch.randn_like(kv, dtype=torch.float32).to(LAYOUT.dtype)
        save = client.save(tokens2, kv2)
        for layer in range(LAYOUT.num_layers):
            save.layer_done(layer)
        if (saved := await save.finished(timeout_s=60)) != 992:
            failed.append(f"layer-wise save stored {saved} tokens, expected 992")
        hit2 = await client.lookup(tokens2)
        into = torch.zeros_like(kv2)
        load = client.load(hit2, into=into, deadline_s=60)
        if not all(load.wait(layer) for layer in range(LAYOUT.num_layers)):
            failed.append("layer-wise load did not deliver every layer")
        if (loaded := await load.finished()) != 992 or not _same(into[:, :, :992], kv2[:, :, :992]):
            failed.append(f"layer-wise load delivered {loaded} tokens, not the 992 saved bit-exact")
    other = Namespace(model="demo", revision=revision + "-r2", layout=LAYOUT)
    async with KVStoreClient(addr, other, use_shm=use_shm, token=token, tls=tls) as client:
        if (found := (await client.lookup(tokens)).num_tokens) != 0:
            failed.append(f"a new revision found {found} tokens, expected 0")
    return failed


async def acceptance(addr: str, token: str | None = None, tls: ClientTLS | None = None) -> dict[str, list[str]]:
    """Transport ("shm", "grpc") -> what was not exact (empty: exact). An exception is a failure too."""
    results: dict[str, list[str]] = {}
    for name, use_shm in (("shm", True), ("grpc", False)):
        try:
            results[name] = await _example(addr, token, tls, use_shm)
        except Exception as exc:  # noqa: BLE001 - the check reports any failure, it does not crash the bench
            results[name] = [f"{type(exc).__name__}: {exc}"]
    return results
