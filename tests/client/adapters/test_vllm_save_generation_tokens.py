"""Review of the saves' generation (DESIGN §3) with a token without the read right: the
connector's client learns no generation at connect (3fd1012: its saves then name none and are
stored in the server's current one). The single-group and the hybrid connector keep that promise
(the hybrid one turned "none" into generation 0, and every save was refused after one invalidation)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_vllm_hybrid_load_costs as hybrid
import torch
from support.servers import ServerProcess
from test_vllm_connector_parts import BLOCK, DIM, HEADS, LAYOUT, NAMES, NUM_BLOCKS, forward, hand_back, step

from kvstore import Namespace
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.hybrid_scheduler import HybridSchedulerSide
from kvstore.client.adapters.vllm.hybrid_worker import HybridWorkerSide
from kvstore.client.adapters.vllm.scheduler import SchedulerSide
from kvstore.client.adapters.vllm.worker import WorkerSide
from kvstore.security.credentials import Credentials

TOKEN_W = "writer-only-token-0123456789abcd"  # tenant w: write, no read


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"tokens": [{"tenant": "w", "rights": ["write"], "token": TOKEN_W}]}))
    auth.chmod(0o600)
    proc = ServerProcess(tmp_path, "--auth-file", str(auth))
    proc.start()
    yield proc
    proc.kill()


def _connect(address: str, model: str, layout) -> StoreConnection:  # type: ignore[no-untyped-def]
    store = StoreConnection(address, Namespace(model=model, revision="r", layout=layout), credentials=Credentials(TOKEN_W))
    assert store.start()
    client = store.client()
    assert client is not None and client.generation_seen is None, "a token without the read right learns none"
    return store


def _invalidate(store: StoreConnection) -> int:
    client = store.client()
    assert client is not None
    return int(store.run(client, client.invalidate(), 5))


def _request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, all_token_ids=list(tokens), kv_transfer_params=None)


def _wait(cond, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_writer_without_the_read_right_keeps_its_saves_after_an_invalidation(server: ServerProcess) -> None:
    """Held (single group): the request names no generation and its save is stored after the invalidation."""
    store = _connect(server.address, "w-plain", LAYOUT)
    caches = {name: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM) for name in NAMES}
    worker = WorkerSide(store, NAMES, BLOCK, NUM_BLOCKS)
    worker.register(caches)
    scheduler = SchedulerSide(store, BLOCK, lookup_timeout_s=5.0)
    for i, req_id in enumerate(["before", "after"]):
        tokens = [1000 * (i + 1) + t for t in range(4 * BLOCK + 1)]
        meta = step(scheduler, req_id, tokens, 0, list(range(5)))
        assert meta.saves and meta.saves[0].generation is None
        forward(worker, meta, fill=float(i), caches=caches)
        _wait(lambda req_id=req_id: req_id in hand_back(worker, scheduler, {req_id}), "the save did not end")
        assert worker.stats.saved_tokens == 4 * BLOCK * (i + 1), f"request {req_id} was not stored"
        if i == 0:  # the first write bound the namespace to tenant w: it may invalidate it
            assert _invalidate(store) == 1
    store.close()


def test_a_hybrid_writer_without_the_read_right_keeps_its_saves_after_an_invalidation(server: ServerProcess) -> None:
    store = _connect(server.address, "w-hybrid", hybrid.LAYOUT)
    caches = {name: torch.zeros(hybrid.NUM_BLOCKS, hybrid.HEADS, hybrid.BLOCK, 2 * hybrid.DIM) for name in hybrid.NAMES}
    worker = HybridWorkerSide(store, hybrid.NAMES, hybrid.GROUPS, hybrid.BLOCK)
    worker.register(caches)
    groups = SimpleNamespace(spec=SimpleNamespace(block_size=hybrid.BLOCK), groups=[SimpleNamespace(index=0),
                                                                                     SimpleNamespace(index=1)],
                             state_groups=[])
    tables = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    scheduler = HybridSchedulerSide(store, groups, 5.0, lambda req_id: tables)  # type: ignore[arg-type]
    p = hybrid.BLOCK
    for i, req_id in enumerate(["before", "after"]):
        tokens = [1000 * (i + 1) + t for t in range(hybrid.PAGES * p + 1)]
        request = _request(req_id, tokens)
        assert scheduler.num_new_matched_tokens(request, 0) == 0
        scheduler.after_alloc(request, 0)
        meta = scheduler.build_meta(SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=tables, num_computed_tokens=0)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={req_id: len(tokens)}, preempted_req_ids=None, finished_req_ids=set()))
        assert meta.group_saves
        hybrid.step(worker, meta)
        assert worker.wait_saves(10)
        worker.finished({req_id})
        assert worker.stats.saved_tokens == hybrid.PAGES * p * (i + 1), \
            f"request {req_id} was not stored: it named generation {meta.group_saves[0].generation}"
        scheduler.finished(request)
        if i == 0:
            assert _invalidate(store) == 1
    store.close()
