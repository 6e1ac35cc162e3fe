"""The decode worker's receive of a handoff (client/adapters/vllm/pd_worker.py, pd_leases.py)
without an engine: a real kvstore-server process (one node: Complete marks the handoff there),
a real StoreConnection with its shared-memory arena, vLLM's CPU block layout. What the real
engines (test_vllm_pd.py) cannot be steered into: a page corrupted in the arena between the
lease and the copy, a worker shut down with a receive not yet landed. Every case ends with no
lease left at the node (a marker's pins and the receive's own leases)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from support.servers import ServerProcess
from test_vllm_connector_parts import store_process  # noqa: F401  # the fixture

from kvstore import KVLayout, Namespace
from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.layout import RequestKV
from kvstore.client.adapters.vllm.metadata import HandoffLoad, KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.pd_worker import HandoffWorker
from kvstore.client.client import KVStoreClient
from kvstore.client.handoff import new_handoff_id
from kvstore.errors import KVStoreError

BLOCK, HEADS, DIM, LAYERS, NUM_BLOCKS, PAGES = 32, 2, 16, 3, 12, 4
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, page_tokens=BLOCK)
NAMESPACE = Namespace(model="pd-receive", revision="r", layout=LAYOUT)
BLOCK_IDS = [7, 2, 9, 4]  # the request's blocks, out of order as vLLM hands them


@pytest.fixture
def server(store_process: ServerProcess) -> ServerProcess:  # noqa: F811  # the imported fixture
    """The parts tests' kvstore-server process (test_vllm_connector_parts.store_process)."""
    return store_process


def caches(shared: bool) -> list[torch.Tensor]:
    """vLLM's CPU KV per layer ``[blocks, heads, block, 2 * dim]``: views of one buffer (the
    one-call copy path) or a tensor each (page by page)."""
    if shared:
        buffer = torch.zeros(LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * DIM)
        return [buffer[i] for i in range(LAYERS)]
    return [torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]


def handed_off(address: str, tokens: list[int], kv: torch.Tensor, namespace: Namespace = NAMESPACE,
               handoff_id: str | None = None) -> str:
    """What the prefill side does, at the one node: put the pages, complete the handoff (a new one
    unless ``handoff_id`` names it: each tensor-parallel rank completes the request's one id)."""
    async def run() -> str:
        async with KVStoreClient(address, namespace) as client:
            assert await client.put(tokens, kv) == len(tokens)
            done_id = handoff_id or new_handoff_id()
            assert await client.handoff_complete(done_id, tokens, "nd") == len(tokens)
            return done_id
    return asyncio.run(run())


def num_leases(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return int(directory_pb2_grpc.DirectoryStub(channel).Stats(directory_pb2.StatsRequest(), timeout=10).num_leases)


def assert_no_lease_left(address: str, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := num_leases(address)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == 0, f"{left} leases left"


def start(address: str, shared: bool,
          max_pages: int | None = None) -> tuple[StoreConnection, HandoffWorker, list[int], torch.Tensor, str]:
    """A worker with a receive of a 4-page handoff begun (its job running in the background);
    ``max_pages``: the most pages its client asks of the node in one call (its acquires batch)."""
    tokens = list(range(1, PAGES * BLOCK + 1))
    kv = torch.randn(LAYERS, 2, len(tokens), HEADS, DIM)
    handoff_id = handed_off(address, tokens, kv)
    store = StoreConnection(address, NAMESPACE)
    assert store.start()
    client = store.client()
    assert client is not None
    client.max_pages = max_pages or client.max_pages
    worker = HandoffWorker(store, BLOCK, open_timeout_s=2.0, complete_timeout_s=5.0)
    worker.register(caches(shared))
    worker.begin_step(KVStoreConnectorMetadata(handoff_loads=[HandoffLoad("r1", handoff_id, tokens, BLOCK_IDS, 0, PAGES, 10.0)]))
    return store, worker, tokens, kv, handoff_id


def job_done(worker: HandoffWorker) -> None:
    deadline = time.monotonic() + 20
    while not worker._receiving[0].job.result.done():
        assert time.monotonic() < deadline, "the receive did not end"
        time.sleep(0.01)


def settle(worker: HandoffWorker) -> set[str]:
    """Steps until the receive is reported finished receiving."""
    deadline = time.monotonic() + 20
    while not (recving := worker.finished(set(), set())[1]):
        assert time.monotonic() < deadline, "never finished receiving"
        time.sleep(0.01)
    return recving


def page_of(worker: HandoffWorker, page: int) -> torch.Tensor:
    kv = RequestKV(worker.blocks, BLOCK_IDS, 0, PAGES, LAYOUT)
    return torch.stack([kv.read_layer(page, layer) for layer in range(LAYERS)])


@pytest.mark.parametrize(("shared", "max_pages"), [(True, None), (False, None), (True, 3)],
                         ids=["one-buffer", "layer-tensors", "acquires-of-3"])
def test_a_receive_copies_the_leased_pages_from_the_arena_and_releases_them(server: ServerProcess, shared: bool,
                                                                           max_pages: int | None) -> None:
    store, worker, _, kv, _ = start(server.address, shared, max_pages)
    try:
        assert settle(worker) == {"r1"}
        assert worker.load_errors() == set() and worker.take_short() == {}
        for page in range(PAGES):
            assert torch.equal(page_of(worker, page), kv[:, :, page * BLOCK : (page + 1) * BLOCK])
        assert worker.stats.received == 1 and worker.stats.received_leased == 1
        assert worker._receiving == []
        assert_no_lease_left(server.address)
    finally:
        worker.shutdown()
        store.close()


@pytest.mark.parametrize("shared", [True, False], ids=["one-buffer", "layer-tensors"])
def test_a_page_corrupted_in_the_arena_fails_its_blocks_from_it_on(server: ServerProcess, shared: bool) -> None:
    """Page 2's bytes change in the arena after the lease: pages 0-1 are copied, the blocks of
    pages 2-3 are reported failed (vLLM recomputes them), and the leases still go back."""
    store, worker, _, kv, _ = start(server.address, shared)
    try:
        job_done(worker)
        taken = worker._receiving[0].taken
        assert taken is not None and taken.num_pages == PAGES
        arena = taken.arenas[0]
        arena.array[taken.offsets[2] + 5] ^= 0xFF
        assert settle(worker) == {"r1"}
        assert worker.load_errors() == {BLOCK_IDS[2], BLOCK_IDS[3]}
        assert worker.take_short() == {"r1": 2}
        for page in range(2):
            assert torch.equal(page_of(worker, page), kv[:, :, page * BLOCK : (page + 1) * BLOCK])
        assert worker.stats.receive_failed == 1 and worker.stats.received == 0
        assert_no_lease_left(server.address)
    finally:
        worker.shutdown()
        store.close()


def test_a_worker_shut_down_before_landing_gives_its_leases_back(server: ServerProcess) -> None:
    store, worker, _, _, _ = start(server.address, shared=True)
    try:
        job_done(worker)
        assert worker._receiving[0].taken is not None and num_leases(server.address) > 0
        worker.shutdown()
        assert_no_lease_left(server.address)
    finally:
        store.close()


def test_a_receive_given_up_on_while_it_waits_leaves_nothing(server: ServerProcess) -> None:
    """The receive's grace ran out while its job still waits for pages that never come: the
    blocks are failed at once, the job is cancelled (a lease its acquire brings meanwhile is
    given back by ``granted``, one it took before by the job's end), and nothing is left."""
    store = StoreConnection(server.address, NAMESPACE)
    assert store.start()
    worker = HandoffWorker(store, BLOCK, open_timeout_s=2.0, complete_timeout_s=5.0)
    worker.register(caches(True))
    tokens = list(range(1, PAGES * BLOCK + 1))
    try:
        worker.begin_step(KVStoreConnectorMetadata(handoff_loads=[HandoffLoad("r1", new_handoff_id(), tokens, BLOCK_IDS, 0,
                                                                              PAGES, 5.0)]))
        rec = worker._receiving[0]
        rec.give_up_at = 0.0  # past its grace already: the next step lands it, whatever the job does
        assert worker.finished(set(), set())[1] == {"r1"}
        assert worker.load_errors() == set(BLOCK_IDS) and worker.stats.receive_failed == 1
        deadline = time.monotonic() + 10
        while not rec.job.result.done():
            assert time.monotonic() < deadline, "the job was not cancelled"
            time.sleep(0.01)
        assert rec.taken is None
        assert_no_lease_left(server.address)
    finally:
        worker.shutdown()
        store.close()


def test_a_receive_whose_wait_got_nothing_lets_go_so_that_a_late_complete_pins_nothing(server: ServerProcess) -> None:
    """A decode's wait answered nothing by its deadline (a slow prefill): the request recomputes, and
    its receive lets go of the handoff at the node, so the prefill's Complete that comes later pins
    nothing. Before, that Complete made the marker again and pinned the pages until the ttl (30 s)."""
    store = StoreConnection(server.address, NAMESPACE)
    assert store.start()
    worker = HandoffWorker(store, BLOCK, open_timeout_s=2.0, complete_timeout_s=5.0)
    worker.register(caches(True))
    tokens, handoff_id = list(range(1, PAGES * BLOCK + 1)), new_handoff_id()
    try:
        worker.begin_step(KVStoreConnectorMetadata(handoff_loads=[HandoffLoad("r1", handoff_id, tokens, BLOCK_IDS, 0, PAGES,
                                                                              0.3)]))
        assert settle(worker) == {"r1"} and worker.stats.receive_failed == 1
        handed_off(server.address, tokens, torch.randn(LAYERS, 2, len(tokens), HEADS, DIM), handoff_id=handoff_id)
        assert_no_lease_left(server.address, within_s=2.0)
    finally:
        worker.shutdown()
        store.close()


def test_the_prefill_step_does_not_wait_for_the_open_and_the_completion_follows_it(server: ServerProcess,
                                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """DESIGN §12.7: a step of a handed-off prefill waited for handoff_open's answer before its
    forward pass (0.7-8 ms of every prompt's TTFT in kvstore-bench pd). The open now runs beside
    the step; the completion is sent only once the open answered, so it never reaches the node
    first (an open landing after it would stay registered there until its ttl). The request is
    finished sending as soon as its saves ended (its pages are stored: vLLM may take its blocks
    back), before the open answered; the completion follows in the background."""
    from kvstore.client.adapters.vllm.metadata import HandoffComplete, HandoffOpen

    tokens = list(range(1, PAGES * BLOCK + 1))
    store = StoreConnection(server.address, NAMESPACE)
    assert store.start()
    client = store.client()
    assert client is not None
    calls: list[str] = []
    real_open, real_complete = client.handoff_open, client.handoff_complete

    async def slow_open(*args: object, **kwargs: object) -> None:
        await asyncio.sleep(2.0)  # far past the bound below: a step that waited for it is told from a slow host's step
        await real_open(*args, **kwargs)  # type: ignore[arg-type]
        calls.append("open")

    async def complete(*args: object, **kwargs: object) -> int:
        calls.append("complete")
        return await real_complete(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(client, "handoff_open", slow_open)
    monkeypatch.setattr(client, "handoff_complete", complete)
    worker = HandoffWorker(store, BLOCK, open_timeout_s=5.0, complete_timeout_s=5.0)
    worker.register(caches(True))
    handoff_id = new_handoff_id()
    try:
        began = time.monotonic()
        worker.begin_step(KVStoreConnectorMetadata(handoff_opens=[HandoffOpen("r1", handoff_id, None, 30.0, tokens)]))
        assert time.monotonic() - began < 1.5, "the step waited for the open's answer"
        asyncio.run(_put(server.address, tokens))  # the saves, as the step stores its pages
        worker.begin_step(KVStoreConnectorMetadata(handoff_completes=[HandoffComplete("r1", handoff_id, None, tokens)]))
        assert worker.finished({"r1"}, {"r1"})[0] == {"r1"}, "the saves ended, yet the blocks are held"
        assert calls == [], "the completion went before the open answered"
        deadline = time.monotonic() + 20
        while worker.stats.completed + worker.stats.complete_failed == 0:
            assert time.monotonic() < deadline, "never completed"
            assert worker.finished(set(), set())[0] == set(), "finished sending twice"
            time.sleep(0.01)
        assert calls == ["open", "complete"]
        worker.finished(set(), set())  # a step counts the open that answered (the completion counts itself)
        assert worker.stats.opened == 1 and worker.stats.completed == 1 and worker.stats.completed_tokens == len(tokens)
    finally:
        worker.shutdown()
        store.close()


async def _put(address: str, tokens: list[int]) -> None:
    async with KVStoreClient(address, NAMESPACE) as client:
        assert await client.put(tokens, torch.randn(LAYERS, 2, len(tokens), HEADS, DIM)) == len(tokens)


@pytest.mark.parametrize("then", ["landed", "shut-down"])
def test_a_receive_whose_client_was_dropped_meanwhile_raises_nothing_and_leaves_no_lease(server: ServerProcess,
                                                                                         then: str) -> None:
    """Bug: the connection dropped and closed the client a receive had leased its pages through (a
    failure: the store restarting) before the receive landed; landing then raised into vLLM's
    get_finished (the copy read the closed client's arena: AttributeError; the give-back asked it for
    its transport: KVStoreError), and so did the worker's shutdown (a cancel on its closed runtime).
    The receive lands from the arena its lease still holds, and the lease goes back through the
    store's client of now (this server: it lives here)."""
    store, worker, _, kv, _ = start(server.address, shared=True)
    try:
        job_done(worker)
        closing = store.failed(store.client(), KVStoreError("the store restarted"))  # type: ignore[arg-type]
        assert closing is not None
        closing.join(10)
        deadline = time.monotonic() + 10
        while store.client() is None:  # connected again
            assert time.monotonic() < deadline, "the store did not reconnect"
            time.sleep(0.05)
        if then == "landed":
            assert settle(worker) == {"r1"} and worker.load_errors() == set()
            for page in range(PAGES):
                assert torch.equal(page_of(worker, page), kv[:, :, page * BLOCK : (page + 1) * BLOCK])
        worker.shutdown()
        assert_no_lease_left(server.address)
    finally:
        store.close()
