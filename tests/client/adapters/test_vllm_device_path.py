"""The vLLM connector's device path (DESIGN §6), run on CPU with the CPU implementation
of the device seam: vLLM's GPU KV layout ([2, blocks, block_size, heads, head_size], the
flash-attention backend's), loads on a side stream with one event per layer that the
engine's stream waits on in wait_for_layer_load, and, from a server with hbm, the pages read
out of the engine's own pool. On a GPU the same lines run with CudaOps (tests_gpu/)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.servers import make_config

from kvstore import KVLayout, Namespace
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.metadata import KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.scheduler import SchedulerSide
from kvstore.client.adapters.vllm.worker import WorkerSide
from kvstore.config import HbmTierConfig
from kvstore.device_ops import CpuOps
from kvstore.server import Server

BLOCK, HEADS, DIM, LAYERS, NUM_BLOCKS = 32, 2, 32, 3, 16
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, page_tokens=BLOCK)
NAMES = [f"model.layers.{i}.attn" for i in range(LAYERS)]


def _parts(address: str, ops: CpuOps | None, **worker_kw: Any) -> tuple[SchedulerSide, WorkerSide, dict[str, torch.Tensor]]:
    store = StoreConnection(address, Namespace(model="device", revision="r", layout=LAYOUT))
    assert store.start()
    caches = {name: torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM) for name in NAMES}  # vLLM's GPU (flash-attn) layout
    worker = WorkerSide(store, NAMES, BLOCK, NUM_BLOCKS, device_ops=ops, load_deadline_s=30, **worker_kw)
    worker.register(caches)
    return SchedulerSide(store, BLOCK, lookup_timeout_s=1.0, load_when_faster=False), worker, caches


def _step(scheduler: SchedulerSide, req_id: str, tokens: list[int], blocks: list[int]) -> KVStoreConnectorMetadata:
    request = SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, all_token_ids=list(tokens))
    hit = scheduler.num_new_matched_tokens(request, 0)
    scheduler.after_alloc(request, hit)
    return scheduler.build_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=hit)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req_id: len(tokens) - hit}, preempted_req_ids=None))


def _forward(worker: WorkerSide, meta: KVStoreConnectorMetadata, caches: dict[str, torch.Tensor],
             fill: bool = False) -> None:
    """vLLM's order of the worker hooks; ``fill``: every block gets values of its own per layer."""
    worker.begin_step(meta)
    worker.start_loads(meta)
    for i, name in enumerate(NAMES):
        worker.wait_layer(name)
        if fill:
            caches[name].copy_(torch.arange(caches[name].numel(), dtype=torch.float32).view_as(caches[name]) + 1000 * i)
        worker.save_layer(name)
    worker.end_step()


def _store_prompt(address: str, tokens: list[int]) -> dict[str, torch.Tensor]:
    scheduler, worker, caches = _parts(address, CpuOps())
    meta = _step(scheduler, "writer", tokens, list(range(4)))
    assert meta.saves and not meta.loads
    _forward(worker, meta, caches, fill=True)
    deadline = time.monotonic() + 10
    while not worker.finished({"writer"}):
        assert time.monotonic() < deadline, "the save did not finish"
        time.sleep(0.01)
    worker.store.close()
    return caches


@pytest.fixture
def hbm_server(tmp_path: Path) -> Server:
    server = Server(dataclasses.replace(make_config(tmp_path), tiers=("hbm", "host", "ssd"),
                                        hbm=HbmTierConfig(capacity_bytes=4 << 20, slab_bytes=1 << 20, device="cpu")))
    server.start()
    yield server  # type: ignore[misc]
    server.stop(grace_s=1)


@pytest.mark.parametrize("sync_load_pages", [0, 8], ids=["layer-wise", "leased-copy"])
def test_a_hit_loads_into_vllms_gpu_layout_through_the_device_path(hbm_server: Server, sync_load_pages: int) -> None:
    tokens = list(range(1, 4 * BLOCK + 2))
    written = _store_prompt(hbm_server.address, tokens)
    ops = CpuOps()
    scheduler, worker, caches = _parts(hbm_server.address, ops, sync_load_pages=sync_load_pages)
    blocks = [10, 11, 12, 13, 14]
    meta = _step(scheduler, "reader", tokens, blocks)
    assert [(spec.first_page, spec.num_pages) for spec in meta.loads] == [(0, 4)]
    _forward(worker, meta, caches)
    assert worker.load_errors() == set()
    for name in NAMES:  # blocks 0..3 of the writer hold the prompt's 4 pages
        assert torch.equal(caches[name][:, 10:14], written[name][:, 0:4]), f"{name}: bit-exact in the GPU layout"
    hbm_in = hbm_server.core.stats().counters["hbm"]["bytes_in"]
    if sync_load_pages:  # the lookup's lease, copied at once: no device placement asked, nothing in the pool
        assert worker.stats.leased_copies == 1 and hbm_in == 0 and ops.num_recorded == 0
    else:  # layer-wise: device placement asked, pages read from the pool on the side stream
        assert hbm_in == 4 * LAYOUT.page_bytes, "the load's pages were placed in the engine's pool"
        assert ops.num_recorded == LAYERS, "one event per layer, recorded on the side stream"
        # wait_for_layer_load made the engine's stream wait on each layer's event, and the step's end again (settle)
        assert ops.num_waited == 2 * LAYERS
    worker.store.close()
