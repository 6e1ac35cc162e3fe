"""The vLLM connector's scheduler and worker sides without an engine: the timing and
fault paths a real engine cannot be steered into (a store that stops answering), and
the configuration errors. Real kvstore-server processes; vLLM's own block layout on CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from support.servers import ServerProcess

from kvstore import KVLayout, Namespace
from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.bench.common.harness import KILL_WAIT_S
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.metadata import KVStoreConnectorMetadata, SaveSpec
from kvstore.client.adapters.vllm.scheduler import SchedulerSide
from kvstore.client.adapters.vllm.worker import WorkerSide
from kvstore.errors import KVStoreError

BLOCK, HEADS, DIM, LAYERS, NUM_BLOCKS = 32, 2, 32, 3, 16
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, page_tokens=BLOCK)
NAMES = [f"model.layers.{i}.attn" for i in range(LAYERS)]


@pytest.fixture
def store_process(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path)
    proc.start()
    yield proc
    assert proc.proc is not None
    if proc.proc.poll() is None:
        os.kill(proc.proc.pid, signal.SIGCONT)
        proc.proc.kill()
        proc.proc.wait(KILL_WAIT_S)


def parts(address: str, lookup_timeout_s: float = 5.0, use_shm: bool = True,
          **worker_kw: Any) -> tuple[StoreConnection, SchedulerSide, WorkerSide, dict[str, torch.Tensor]]:
    """``lookup_timeout_s``: generous unless a test is about it (0.2 s missed lookups on a loaded CI)."""
    store = StoreConnection(address, Namespace(model="parts", revision="r", layout=LAYOUT), use_shm=use_shm)
    assert store.start()
    caches = {name: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM) for name in NAMES}  # vLLM's CPU layout
    worker = WorkerSide(store, NAMES, BLOCK, NUM_BLOCKS, **worker_kw)
    worker.register(caches)
    return store, SchedulerSide(store, BLOCK, lookup_timeout_s=lookup_timeout_s), worker, caches


def new_request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    """What the connector reads of vLLM's Request (all_token_ids grows with the output)."""
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, all_token_ids=list(tokens))


def step(scheduler: SchedulerSide, req_id: str, tokens: list[int], computed: int, blocks: list[int],
         request: SimpleNamespace | None = None) -> KVStoreConnectorMetadata:
    """What vLLM's scheduler does for a new request: ask, allocate, build the step's metadata."""
    request = request or new_request(req_id, tokens)
    hit = scheduler.num_new_matched_tokens(request, computed)
    scheduler.after_alloc(request, hit)
    return scheduler.build_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed + hit)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req_id: len(tokens) - computed - hit}, preempted_req_ids=None))


def cached_step(scheduler: SchedulerSide, req_id: str, computed: int, scheduled: int) -> KVStoreConnectorMetadata:
    """A later step of a running request (no new blocks): ``scheduled`` tokens from ``computed`` on."""
    return scheduler.build_meta(SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[req_id], resumed_req_ids=set(), new_block_ids=[None],
                                              num_computed_tokens=[computed]),
        num_scheduled_tokens={req_id: scheduled}, preempted_req_ids=None))


def hand_back(worker: WorkerSide, scheduler: SchedulerSide, finished: set[str] | None = None) -> set[str]:
    """What vLLM does after each step: the workers' finished requests and their report go
    to the scheduler side."""
    done = worker.finished(finished or set())
    scheduler.saves_finished(done)
    scheduler.saves_short(worker.report())
    return done


def break_connection(store: StoreConnection, why: str) -> None:
    """The connection breaks: its client dropped as the connector drops one on a transport
    failure, and closed (its saves abandoned) before this returns."""
    client = store.client()
    assert client is not None
    closing = store.failed(client, KVStoreError(why))
    assert closing is not None, "the broken connection was kept"
    closing.join(10)


def reconnected(store: StoreConnection, timeout_s: float = 10.0) -> None:
    """Returns once the connection is back (it reconnects after retry_s)."""
    deadline = time.monotonic() + timeout_s
    while store.client() is None:
        assert time.monotonic() < deadline, "no reconnection"
        time.sleep(0.05)


def forward(worker: WorkerSide, meta: KVStoreConnectorMetadata, fill: float | None = None,
            caches: dict[str, torch.Tensor] | None = None) -> None:
    """One step of the worker hooks in vLLM's order; ``fill`` writes every block as the
    model would (so that saves have KV to copy)."""
    worker.begin_step(meta)
    worker.start_loads(meta)
    for i, name in enumerate(NAMES):
        worker.wait_layer(name)
        if fill is not None and caches is not None:
            caches[name].fill_(fill + i)
        worker.save_layer(name)
    worker.end_step()


def store_prompt(address: str, tokens: list[int]) -> None:
    _, scheduler, worker, caches = parts(address)
    meta = step(scheduler, "writer", tokens, 0, list(range(4)))
    assert meta.saves and not meta.loads
    forward(worker, meta, fill=1.0, caches=caches)
    deadline = time.monotonic() + 10
    while not worker.finished({"writer"}):
        assert time.monotonic() < deadline, "the save did not finish"
        time.sleep(0.01)
    worker.store.close()


def num_leases(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return int(directory_pb2_grpc.DirectoryStub(channel).Stats(directory_pb2.StatsRequest(), timeout=10).num_leases)


def test_lookup_of_a_stopped_store_is_a_bounded_miss(store_process: ServerProcess) -> None:
    """The scheduler never waits past lookup_timeout_s on a store that stopped answering;
    the lease the store grants once it runs again is given back."""
    tokens = list(range(1, 2 * BLOCK + 2))
    store_prompt(store_process.address, tokens)
    store, scheduler, _, _ = parts(store_process.address, lookup_timeout_s=0.2)
    assert store_process.proc is not None
    store_process.freeze()
    try:
        start = time.monotonic()
        hit = scheduler.num_new_matched_tokens(SimpleNamespace(request_id="r", prompt_token_ids=tokens), 0)
        assert hit == 0 and time.monotonic() - start < 2.0  # bounded: the frozen store never answers
    finally:
        os.kill(store_process.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while num_leases(store_process.address):  # the late answer comes, then its release
        assert time.monotonic() < deadline, "the lease granted after the timeout was never given back"
        time.sleep(0.01)
    answered = [scheduler.num_new_matched_tokens(SimpleNamespace(request_id=f"r{i}", prompt_token_ids=tokens), 0)
                for i in range(2, 12)]  # a 0.2 s lookup may miss on a loaded machine; the store answers again
    assert 2 * BLOCK in answered
    store.close()


@pytest.mark.parametrize("sync_load_pages", [0, 8])
def test_load_from_a_store_that_stops_after_the_lookup(store_process: ServerProcess, sync_load_pages: int) -> None:
    """Layer-wise: the worker's wait ends at the load deadline and every loaded block is
    reported failed. Leased copy: the lookup's lease already says where the bytes are, so
    the pages load without the store (verified against their checksums)."""
    tokens = list(range(1, 4 * BLOCK + 2))
    store_prompt(store_process.address, tokens)
    store, scheduler, worker, caches = parts(store_process.address, load_deadline_s=0.5, sync_load_pages=sync_load_pages)
    meta = step(scheduler, "reader", tokens, 0, [10, 11, 12, 13, 14])
    assert [(spec.first_page, spec.num_pages) for spec in meta.loads] == [(0, 4)]
    assert store_process.proc is not None
    store_process.freeze()
    try:
        start = time.monotonic()
        forward(worker, meta)
        elapsed = time.monotonic() - start
    finally:
        os.kill(store_process.proc.pid, signal.SIGCONT)
    if sync_load_pages:
        assert worker.load_errors() == set() and elapsed < 1.0
        assert all(bool((caches[name][10:14] == 1.0 + i).all()) for i, name in enumerate(NAMES))
    else:
        assert worker.load_errors() == {10, 11, 12, 13} and elapsed < 1.5
        assert all(bool((caches[name][10:14] == 0).all()) for name in NAMES), "no byte of a failed load lands"
    store.close()


def test_save_is_not_published_when_the_same_steps_load_failed(store_process: ServerProcess) -> None:
    """The KV a step computes after a failed load is wrong: its save is cancelled, the
    store finds no page of it."""
    tokens = list(range(1, 2 * BLOCK + 2))
    store_prompt(store_process.address, tokens)
    longer = tokens[: 2 * BLOCK] + list(range(500, 500 + 3 * BLOCK))
    store, scheduler, worker, caches = parts(store_process.address, load_deadline_s=0.3, sync_load_pages=0)
    meta = step(scheduler, "r", longer, 0, list(range(5, 10)))
    assert meta.loads and meta.saves and meta.saves[0].first_page == 2
    assert store_process.proc is not None
    store_process.freeze()
    try:
        forward(worker, meta, fill=5.0, caches=caches)
    finally:
        os.kill(store_process.proc.pid, signal.SIGCONT)
    assert worker.load_errors() == {5, 6}
    deadline = time.monotonic() + 10
    while not worker.finished({"r"}):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert worker.stats.saves_cancelled == 1 and worker.stats.saved_tokens == 0
    client = store.client()
    assert client is not None
    assert store.run(client, client.lookup(longer), 5).num_pages == 2, "only the pages stored before"
    store.close()


def test_finished_requests_are_reported_once_their_saves_end(store_process: ServerProcess) -> None:
    """vLLM keeps a finished request's blocks while its save may read them, and frees
    them when the worker reports it: every request with a save is reported exactly once."""
    store, scheduler, worker, caches = parts(store_process.address)
    tokens = list(range(7, 7 + 3 * BLOCK))
    meta = step(scheduler, "a", tokens, 0, [0, 1, 2])
    assert isinstance(meta.saves[0], SaveSpec)
    forward(worker, meta, fill=2.0, caches=caches)
    assert scheduler.finished(SimpleNamespace(request_id="a")) is True and scheduler.holds_blocks
    reported: set[str] = set()
    deadline = time.monotonic() + 10
    while not reported:
        reported = worker.finished({"a"} if not reported else set())
        assert time.monotonic() < deadline
    assert reported == {"a"} and worker.finished(set()) == set()
    scheduler.saves_finished(reported)
    assert not scheduler.holds_blocks
    assert scheduler.finished(SimpleNamespace(request_id="never-seen")) is False
    store.close()


def test_client_closed_mid_step_publishes_no_uncomputed_layer(store_process: ServerProcess) -> None:
    """Closing a client ends its layer-wise saves at once; a save whose later layers vLLM
    has not computed yet must fail, not publish them (the client abandons it; the
    connector's guard on uncomputed layers stands behind that)."""
    store, scheduler, worker, caches = parts(store_process.address)
    tokens = list(range(3, 3 + 2 * BLOCK + 1))
    meta = step(scheduler, "r", tokens, 0, [0, 1, 2])
    worker.begin_step(meta)
    worker.start_loads(meta)
    caches[NAMES[0]].fill_(1.0)
    worker.save_layer(NAMES[0])  # layer 0 computed; layers 1 and 2 not yet
    client = store.client()
    assert client is not None
    store.failed(client, "test: the connection broke mid-step")
    save = worker._saves[0].save
    save.join(10)
    reader = StoreConnection(store_process.address, store.namespace)
    assert reader.start()
    fresh = reader.client()
    assert fresh is not None
    assert reader.run(fresh, fresh.lookup(tokens), 5).num_pages == 0, "no page of the half-computed step is published"
    assert save.error is not None and ("abandoned" in str(save.error) or "not computed yet" in str(save.error))
    reader.close()
    store.close()


def test_only_transport_failures_drop_the_connection(store_process: ServerProcess) -> None:
    """An error the server answered with (a full tier, a missing page) says the connection
    works: it is kept. A transport failure drops it, and the next use reconnects."""
    from kvstore.errors import KVStoreError, TierFull

    store = StoreConnection(store_process.address, Namespace(model="parts", revision="r", layout=LAYOUT))
    assert store.start()
    client = store.client()
    assert client is not None
    store.failed(client, TierFull("host tier full"))
    assert store.client() is client
    store.failed(client, KVStoreError("UNAVAILABLE"))
    assert store.client() is not client  # None now: a new connection is being made
    store.close()


def test_close_ends_the_close_of_a_dropped_client(store_process: ServerProcess) -> None:
    """Regression: a client dropped after a transport failure was closed on the connection's
    private event loop, which close() stopped before that close ended ("Task was destroyed
    but it is pending! ... KVStoreClient.close()"): its arena stayed mapped. Now close()
    returns once every dropped client is closed."""
    from kvstore.errors import KVStoreError

    store = StoreConnection(store_process.address, Namespace(model="parts", revision="r", layout=LAYOUT))
    assert store.start()
    client = store.client()
    assert client is not None and client.shared_memory
    store.failed(client, KVStoreError("UNAVAILABLE"))
    store.close()
    assert not client.shared_memory, "the dropped client's close did not end"
    with pytest.raises(KVStoreError, match="closed"):
        store.run(client, client.lookup([1, 2, 3]), 1)


@pytest.mark.parametrize("how", ["cancelled", "failed"])
def test_a_save_that_ended_short_is_saved_again(store_process: ServerProcess, how: str) -> None:
    """Regression: the scheduler counted a save's pages as stored when it scheduled it and
    never took that back when the save was cancelled (its step's load failed) or failed (the
    connection broke): those pages were never saved again, and a later save started after
    them, past a gap no lookup crosses. Now the workers report a save that ended short and
    the request's next step saves again from the pages that are stored."""
    address = store_process.address
    if how == "cancelled":  # 2 pages stored; a 5-page prompt whose load of them fails
        tokens = list(range(1, 2 * BLOCK + 1)) + list(range(500, 500 + 3 * BLOCK))
        store_prompt(address, tokens[: 2 * BLOCK + 1])
        store, scheduler, worker, caches = parts(address, load_deadline_s=0.3, sync_load_pages=0)
        meta = step(scheduler, "r", tokens, 0, list(range(5, 10)))
        assert [(s.first_page, len(s.tokens) // BLOCK) for s in meta.saves] == [(2, 5)]
        assert store_process.proc is not None
        store_process.freeze()
        try:
            forward(worker, meta, fill=5.0, caches=caches)
        finally:
            os.kill(store_process.proc.pid, signal.SIGCONT)
        assert worker.load_errors() == {5, 6}
        assert worker.wait_saves(10)
        hand_back(worker, scheduler)
        again = cached_step(scheduler, "r", 0, len(tokens))  # vLLM recomputes from the failed blocks on
    else:  # a 3-page prompt whose save fails when the connection breaks mid-step
        tokens = list(range(11, 11 + 3 * BLOCK + 1))
        store, scheduler, worker, caches = parts(address)
        request = new_request("r", tokens)
        meta = step(scheduler, "r", tokens, 0, [0, 1, 2, 3], request=request)
        worker.begin_step(meta)
        worker.start_loads(meta)
        break_connection(store, "test: the connection broke mid-step")  # its saves abandoned before the engine marks their layers
        for i, name in enumerate(NAMES):
            caches[name].fill_(7.0 + i)
            worker.save_layer(name)
        worker.end_step()
        assert worker.wait_saves(10)
        hand_back(worker, scheduler)
        reconnected(store)
        request.all_token_ids.append(99)  # the first output token, computed in the next (decode) step
        again = cached_step(scheduler, "r", len(tokens), 1)
    assert [(s.first_page, len(s.tokens) // BLOCK) for s in again.saves] == [(2 if how == "cancelled" else 0, len(tokens) // BLOCK)]
    forward(worker, again, fill=5.0, caches=caches)
    assert worker.wait_saves(10)
    fresh = store.client()
    assert fresh is not None
    assert store.run(fresh, fresh.lookup(tokens), 5).num_pages == len(tokens) // BLOCK
    store.close()


def test_close_from_atexit_is_clean(store_process: ServerProcess) -> None:
    """An engine may shut its connector down from an atexit handler (vLLM does, at exit),
    when no thread pool takes work any more: the close says so in one line, not in a
    traceback from the thread that closes the client."""
    script = f"""
import atexit, logging, torch
from kvstore import KVLayout, Namespace
from kvstore.client.adapters.connection import StoreConnection
logging.basicConfig(level=logging.INFO)
layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, page_tokens=4)
store = StoreConnection({store_process.address!r}, Namespace(model="m", revision="r", layout=layout))
assert store.start()
atexit.register(store.close)
"""
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "left open at interpreter exit" in result.stderr
