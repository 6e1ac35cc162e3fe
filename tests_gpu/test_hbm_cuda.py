"""The hbm tier and the device seam's CUDA implementation (kvstore/device_cuda.py) on a real
CUDA device: bit-exact put/get, a damaged byte caught, a pool handed out as CUDA IPC and read
(and written) from a second process, each pool its own CUDA segment (an IPC handle opens the
whole segment), the pinned host arena, host -> hbm bytes/s beside a plain pinned copy_."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import subprocess
import sys
import time

import torch
from pages import QWEN3_8B_PAGE, page

from kvstore.config import HbmTierConfig
from kvstore.device_cuda import CudaOps
from kvstore.device_ops import host_address
from kvstore.tiers.hbm import HbmTier

CHILD = r"""
import hashlib, json, sys, torch
from kvstore.device_cuda import CudaOps
from kvstore.device_ops import PoolHandout
req = json.load(sys.stdin)
handout = PoolHandout(req["device"], req["size_bytes"], bytes.fromhex(req["token"]), handle=req["handle"])
pool = CudaOps(torch.device(req["device"])).open_pool(handout, writable=True).tensor
digests = [hashlib.sha256(pool[s : s + n].cpu().numpy().tobytes()).hexdigest() for s, n in req["pages"]]
s, n = req["write_at"]
pool[s : s + n].fill_(0xA5)  # the importer writes too: it is the same device memory
torch.cuda.synchronize()
print(json.dumps({"digests": digests, "device": str(pool.device), "num_bytes": pool.numel()}))
"""


def _tier(capacity: int = 256 << 20) -> HbmTier:
    tier = HbmTier(HbmTierConfig(capacity_bytes=capacity, device="cuda"))
    assert tier.pool.device.type == "cuda" and tier.pool.numel() > 0
    return tier


def _store(tier: HbmTier, pages: list[int]) -> dict[int, int]:
    slots = {}
    for i in pages:
        header, payload = page(i)
        slot = tier.reserve(header.payload_bytes)
        assert slot is not None
        tier.write([(slot, header, memoryview(payload))])
        tier.commit([(slot, header)])
        slots[i] = slot
    return slots


def test_hbm_put_get_is_bit_exact_on_cuda() -> None:
    tier = _tier()
    try:
        slots = _store(tier, list(range(24)))
        bufs = [bytearray(QWEN3_8B_PAGE.page_bytes) for _ in slots]
        result = tier.read_into([(page(i)[0].key, memoryview(b)) for i, b in zip(slots, bufs)])
        assert result.num_read == 24, result
        for (i, slot), buf in zip(slots.items(), bufs):
            assert bytes(buf) == bytes(page(i)[1])
            assert bytes(tier.device_view(slot, len(buf)).cpu().numpy()) == bytes(page(i)[1]), "the device bytes"
        tier.pool[slots[5] + 1234] ^= 0xFF  # a stray device write
        result = tier.read_into([(page(i)[0].key, memoryview(bytearray(QWEN3_8B_PAGE.page_bytes))) for i in range(24)])
        assert result.num_read == 5 and "checksum" in result.reason
        assert tier.usage().num_pages == 24
    finally:
        tier.close()


def test_cuda_ipc_read_and_write_from_a_second_process(figures) -> None:
    tier = _tier()
    try:
        slots = _store(tier, list(range(8)))
        spare = tier.reserve(QWEN3_8B_PAGE.page_bytes)
        assert spare is not None
        tier.pool[spare : spare + 4096].zero_()
        torch.cuda.synchronize()
        handout = tier.handout
        assert handout.fd == -1 and handout.handle and handout.device.startswith("cuda")
        request = {"handle": handout.handle, "device": handout.device, "size_bytes": handout.size_bytes,
                   "token": handout.token.hex(), "pages": [[tier.offset(slots[i]), QWEN3_8B_PAGE.page_bytes] for i in range(8)],
                   "write_at": [tier.offset(spare), 4096]}
        start = time.perf_counter()
        child = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(request), capture_output=True, text=True,
                               check=False, timeout=180, env=dict(os.environ))
        figures["ipc_child_process_s"] = round(time.perf_counter() - start, 3)
        assert child.returncode == 0, child.stderr[-3000:]
        answer = json.loads(child.stdout.strip().splitlines()[-1])
        assert answer["digests"] == [hashlib.sha256(bytes(page(i)[1])).hexdigest() for i in range(8)]
        assert answer["num_bytes"] == tier.pool.numel()
        assert bool((tier.pool[spare : spare + 4096] == 0xA5).all()), "the importer's write is seen by the exporter"
    finally:
        tier.close()


def test_each_pool_is_a_cuda_segment_of_its_own() -> None:
    """Two pools (two tenants'): each handle opens exactly its pool's segment, at offset 0, so
    one tenant's handle reaches no byte of the other's pool (nor anything else of the server)."""
    first, second = _tier(64 << 20), _tier(64 << 20)
    try:
        for tier in (first, second):
            h = json.loads(tier.handout.handle)
            assert h["storage_offset_bytes"] == 0 and h["tensor_offset"] == 0
            assert h["storage_size_bytes"] == -(-tier.pool.numel() // (2 << 20)) * (2 << 20)
        a, b = first.pool.data_ptr(), second.pool.data_ptr()
        assert a + first.pool.numel() <= b or b + second.pool.numel() <= a
        assert json.loads(first.handout.handle)["handle"] != json.loads(second.handout.handle)["handle"]
    finally:
        first.close()
        second.close()


def test_pinned_arena_and_host_to_hbm_bytes_per_s(figures) -> None:
    """Host -> hbm through HbmTier.write from a pinned arena, beside a plain pinned copy_ of the
    same bytes (the goal: >= 0.8x). Figures only; no speed is asserted."""
    num_pages = 64
    nbytes = QWEN3_8B_PAGE.page_bytes
    arena = mmap.mmap(-1, num_pages * nbytes)
    view = memoryview(arena)
    ops = CudaOps(torch.device("cuda"))
    address = host_address(view)
    assert ops.pin_host(address, len(arena)), "cudaHostRegister refused the arena"
    tier = _tier(capacity=(num_pages + 16) * nbytes)
    host: torch.Tensor | None = None
    try:
        headers = []
        for i in range(num_pages):
            header, payload = page(i)
            view[i * nbytes : (i + 1) * nbytes] = payload
            headers.append(header)
        host = torch.frombuffer(view, dtype=torch.uint8)
        assert host.is_pinned(), "a cudaHostRegister'ed mapping counts as pinned"
        slots = [tier.reserve(nbytes) for _ in range(num_pages)]
        for _ in range(2):  # warm-up, then timed
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i, (slot, header) in enumerate(zip(slots, headers)):
                tier.write([(slot, header, view[i * nbytes : (i + 1) * nbytes])])  # type: ignore[arg-type]
            torch.cuda.synchronize()
            tier_s = time.perf_counter() - start
            dst = tier.pool[: num_pages * nbytes]
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(host[: num_pages * nbytes], non_blocking=True)
            torch.cuda.synchronize()
            plain_s = time.perf_counter() - start
        tier.commit(list(zip(slots, headers)))  # type: ignore[arg-type]
        out = bytearray(nbytes)
        assert tier.read_into([(headers[7].key, memoryview(out))]).num_read == 1 and bytes(out) == bytes(page(7)[1])
        total = num_pages * nbytes
        figures["host_to_hbm_tier_write_GBps"] = round(total / tier_s / 1e9, 2)
        figures["host_to_hbm_plain_pinned_copy_GBps"] = round(total / plain_s / 1e9, 2)
        figures["host_to_hbm_ratio"] = round(plain_s / tier_s, 3)
        figures["host_to_hbm_bytes"] = total
    finally:
        tier.close()
        del host  # its export of the mapping goes before the mapping
        ops.unpin_host(address)
        view.release()
        arena.close()
