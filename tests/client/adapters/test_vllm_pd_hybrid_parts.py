"""Disaggregated prefill on hybrid engines (hybrid_handoff.py, hybrid_worker.py, pd.py) without
an engine: a real kvstore-server process, the connector's sides driven in vLLM's order (as
test_vllm_hybrid_load_costs.py and test_vllm_pd_receive.py do). Written by an adversarial
review of the first version, each failed on it (DESIGN §12.7)."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest
import test_vllm_hybrid_load_costs as hybrid
import test_vllm_pd_receive
import torch
from support.servers import ServerProcess

from kvstore import Namespace
from kvstore._proto import directory_pb2
from kvstore.bench.common.linkproxy import LinkProxy
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.connector import KVStoreConnector
from kvstore.client.adapters.vllm.hybrid_scheduler import HybridSchedulerSide
from kvstore.client.adapters.vllm.hybrid_worker import HybridWorkerSide
from kvstore.client.adapters.vllm.metadata import GroupLoad, KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.pd import HandoffScheduler
from kvstore.client.adapters.vllm.pd_worker import HandoffWorker
from kvstore.client.client import KVStoreClient
from kvstore.client.handoff import new_handoff_id

BLOCK, PAGES = hybrid.BLOCK, hybrid.PAGES
NAMESPACE = Namespace(model="review-pd-hybrid", revision="r", layout=hybrid.LAYOUT)
TABLES = ([0, 10, 11, 12], [13, 14, 15, 9])  # the window group's first block dropped (vLLM's null block 0)


@pytest.fixture
def store(server_process: ServerProcess) -> ServerProcess:
    server_process.start()
    return server_process


def handed_off(address: str, tokens: list[int]) -> str:
    """The prefill side at the one node: the pages put, the handoff completed (the marker made)."""
    kv = torch.randn(hybrid.LAYOUT.num_layers, 2, len(tokens), hybrid.HEADS, hybrid.DIM)
    return test_vllm_pd_receive.handed_off(address, tokens, kv, NAMESPACE)


def decode_worker(address: str, **conn: bool) -> tuple[StoreConnection, KVStoreConnector]:
    """A hybrid engine's worker connector (its worker side and its handoff worker, as
    KVStoreConnector.__init__ makes them), without vLLM's config."""
    store = StoreConnection(address, NAMESPACE, **conn)
    assert store.start()
    side = HybridWorkerSide(store, hybrid.NAMES, hybrid.GROUPS, BLOCK)  # load_deadline_s: not configured (the default)
    side.register({name: torch.zeros(hybrid.NUM_BLOCKS, hybrid.HEADS, BLOCK, 2 * hybrid.DIM) for name in hybrid.NAMES})
    connector = object.__new__(KVStoreConnector)
    connector.store, connector.states, connector.hybrid, connector.worker = store, None, True, side
    connector.scheduler = None
    connector.handoff_worker = HandoffWorker(store, BLOCK, 5.0, 10.0, push_layers=False)
    return store, connector


def engine_step(connector: KVStoreConnector, meta: KVStoreConnectorMetadata,
                finished_req_ids: set[str] | None = None) -> tuple[set[str], set[str], float]:
    """One step in vLLM's order (kv_connector_model_runner_mixin, asynchronous loads): the
    connector's hooks; returns (finished_recving, failed_recving, seconds the hooks took)."""
    started = time.monotonic()
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)  # type: ignore[arg-type]
    connector.wait_for_save()
    results = connector.get_transfer_results(finished_req_ids or set())
    connector.clear_connector_metadata()
    return set(results.finished_recving or ()), set(results.failed_recving or ()), time.monotonic() - started


def test_a_handoff_is_received_in_the_background_not_in_the_engines_step(store: ServerProcess) -> None:
    """A store that answers slowly once the marker answered (a 20 kB/s link to it, 1.6 s a page)
    and a request that asked for a 30 s wait: no step of the engine is held by it (the pages are
    got in the background and written between steps, as the single-group decode, pd_worker.py,
    does). Its first version loaded synchronously between steps, bounded by the request's own
    wait deadline (up to 600 s): one step's hooks took ~6.4 s here."""
    tokens = [random.Random(5).randrange(1, 50_000) for _ in range(PAGES * BLOCK)]
    handoff_id = handed_off(store.address, tokens)
    proxy = LinkProxy(store.address, 20e3)
    conn, connector = decode_worker(proxy.address, use_shm=False, use_call_socket=False)
    try:
        load = GroupLoad("d", tokens, TABLES, 0, PAGES, handoff_id=handoff_id, handoff_wait_s=30.0)  # kvstore_deadline_s: 30
        longest, done, deadline = 0.0, set(), time.monotonic() + 60
        metas = [KVStoreConnectorMetadata(group_loads=[load], num_scheduled_tokens=5)]
        while not done:
            assert time.monotonic() < deadline, "the handoff never landed"
            done, _, seconds = engine_step(connector, metas.pop() if metas else KVStoreConnectorMetadata(num_scheduled_tokens=5))
            longest = max(longest, seconds)
        assert longest < 1.0, (f"one engine step was held {longest:.1f} s by a handoff's load (the request's "
                               f"kvstore_deadline_s bounds it; a hit's load is cut at the cost model's deadline)")
    finally:
        connector.worker.shutdown()  # type: ignore[union-attr]
        conn.close()
        proxy.close()


def test_an_aborted_decode_is_reported_so_that_vllm_frees_its_blocks(store: ServerProcess) -> None:
    """vLLM aborts a request that waits for its KV (WAITING_FOR_REMOTE_KVS: a client that went
    away): Scheduler.finish_requests keeps its blocks until the connector reports it in
    finished_recving, and tells the workers in ``finished_req_ids``: the receive ends and the
    request is reported in that step. Its first version never looked at them: the request was
    reported when its wait ended, at its deadline + 5 s (up to 605 s), its blocks held till then."""
    tokens = [random.Random(6).randrange(1, 50_000) for _ in range(PAGES * BLOCK)]
    conn, connector = decode_worker(store.address)
    try:
        load = GroupLoad("d", tokens, TABLES, 0, PAGES, handoff_id=new_handoff_id(), handoff_wait_s=600.0)
        assert engine_step(connector, KVStoreConnectorMetadata(group_loads=[load]))[0] == set()
        assert len(connector.worker.receives) == 1  # type: ignore[union-attr]
        reported, deadline = set(), time.monotonic() + 5
        aborted = {"d"}  # the step after the abort: vLLM's scheduler_output.finished_req_ids
        while "d" not in reported and time.monotonic() < deadline:
            reported |= engine_step(connector, KVStoreConnectorMetadata(), aborted)[0]
            aborted = set()
            time.sleep(0.05)
        assert "d" in reported, ("5 s after its abort the decode was not reported finished receiving: vLLM holds its "
                                 f"blocks until its wait ends ({len(connector.worker.receives)} wait still running, "  # type: ignore[union-attr]
                                 "600 s + 5 s)")
    finally:
        connector.worker.shutdown()  # type: ignore[union-attr]
        conn.close()


def test_a_prefill_hands_off_only_the_pages_it_saved(store: ServerProcess) -> None:
    """A hybrid (sliding-window) prefill whose prompt vLLM's own prefix cache covers while
    kvstore does not hold it (evicted, invalidated, a node restarted): vLLM's table has the
    window group's out-of-window blocks dropped (null), so HybridSchedulerSide._plan_save saves
    no page of it; the prefill hands off nothing (HybridSchedulerSide.handoff_limit). Its first
    version returned every whole page of the prompt as handed off: the decode waited its whole
    deadline (the marker never completes) before it recomputed."""
    prompt = [random.Random(7).randrange(1, 50_000) for _ in range(PAGES * BLOCK + 9)]
    conn = StoreConnection(store.address, NAMESPACE)
    assert conn.start()
    # as vLLM hands the hybrid manager's table of a request whose first 4 blocks are its own
    # cache's hit: the window (48 tokens) group drops the blocks before token 128 - 48
    tables = ([1, 2, 3, 4, 5], [0, 0, 8, 9, 10])
    groups = SimpleNamespace(spec=SimpleNamespace(block_size=BLOCK), groups=[SimpleNamespace(index=0), SimpleNamespace(index=1)],
                             state_groups=[])
    scheduler = HybridSchedulerSide(conn, groups, 5.0, lambda req_id: tables)  # type: ignore[arg-type]
    connector = object.__new__(KVStoreConnector)
    connector.store, connector.scheduler, connector.hybrid, connector.sessions = conn, scheduler, True, None
    connector._warned_sessions = False
    connector.handoffs = HandoffScheduler(scheduler, deadline_s=2.0, ttl_s=30.0)
    request = SimpleNamespace(request_id="p", prompt_token_ids=prompt, all_token_ids=list(prompt), status=SimpleNamespace(name="WAITING"),
                              kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False}, num_computed_tokens=0)
    try:
        local_hit = PAGES * BLOCK
        assert connector.get_num_new_matched_tokens(request, local_hit) == (0, False), "kvstore holds none of it"
        connector.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: tables), 0)
        meta = connector.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="p", block_ids=tables, num_computed_tokens=local_hit)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={"p": len(prompt) - local_hit}, preempted_req_ids=None, finished_req_ids=set()))
        assert len(meta.handoff_opens) == 1 and not meta.group_saves, "precondition: no page is saved"
        request.status, request.num_computed_tokens = SimpleNamespace(name="FINISHED_LENGTH_CAPPED"), len(prompt)
        _, params = connector.request_finished_all_groups(request, tables)
        assert params is not None
        handed = params["kvstore_num_tokens"]
        (complete,) = connector.handoffs.add_to(KVStoreConnectorMetadata()).handoff_completes

        async def decode_waits() -> tuple[int, float]:  # what the prefill's worker, then the decode's, then do
            async with KVStoreClient(store.address, NAMESPACE) as client:
                await client.handoff_complete(complete.handoff_id, complete.tokens, None)
                started = time.monotonic()
                hit = await client.handoff_wait(complete.handoff_id, prompt[:handed], 2.0)
                return hit.num_tokens, time.monotonic() - started
        got, waited = asyncio.run(decode_waits()) if handed else (0, 0.0)
        assert handed == 0, (f"the prefill handed off {handed} tokens it never saved: the decode's wait got {got} "
                             f"after {waited:.1f} s (its whole deadline), then it recomputes")
    finally:
        conn.close()


def test_a_handoff_a_state_space_decode_cannot_take_is_let_go_at_once(store: ServerProcess) -> None:
    """A state-space model's decode of the prefill's own prompt (kvstore-pd-proxy's chat path): its
    hit must end a block before the states saved, so it is offered nothing; the pages handed off for
    it are let go at its node at once (the decode declines the handoff), not kept pinned until the
    handoff's ttl (30 s here). Before, they were."""
    prompt = [random.Random(8).randrange(1, 50_000) for _ in range(PAGES * BLOCK)]
    handoff_id = handed_off(store.address, prompt)  # the marker at this node pins every page

    async def leases() -> int:
        async with KVStoreClient(store.address, NAMESPACE) as client:
            return int((await client._call(client.runtime.directory.Stats, directory_pb2.StatsRequest())).num_leases)
    assert asyncio.run(leases()) >= 1
    conn = StoreConnection(store.address, NAMESPACE)
    assert conn.start()
    groups = SimpleNamespace(spec=SimpleNamespace(block_size=BLOCK), groups=[SimpleNamespace(index=1)],
                             state_groups=[SimpleNamespace(index=0, block_size=BLOCK)])
    try:
        handoffs = HandoffScheduler(HybridSchedulerSide(conn, groups, 5.0, lambda req_id: ([], [])),  # type: ignore[arg-type]
                                    deadline_s=10.0, ttl_s=30.0)
        params = {"do_remote_prefill": True, "do_remote_decode": False, "kvstore_handoff_id": handoff_id,
                  "kvstore_num_tokens": len(prompt)}
        chat = SimpleNamespace(request_id="d", prompt_token_ids=prompt, all_token_ids=list(prompt), kv_transfer_params=params,
                               status=SimpleNamespace(name="WAITING"), num_computed_tokens=0)
        assert handoffs.matched(chat, 0) == (0, False), "offered nothing: no states a block before the last page"
        deadline = time.monotonic() + 5
        while asyncio.run(leases()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert asyncio.run(leases()) == 0, "the declined handoff's pages stayed pinned"
    finally:
        conn.close()


def test_a_receive_that_found_no_store_starts_when_the_store_is_back(store: ServerProcess) -> None:
    """A hybrid decode whose load came while its store connection was down (a node restarting:
    no client that step) is started again at the next steps, until its wait's end, and lands, as
    the single-group decode's does (pd_receives.py). Before, it failed at once and recomputed."""
    tokens = [random.Random(9).randrange(1, 50_000) for _ in range(PAGES * BLOCK)]
    handoff_id = handed_off(store.address, tokens)
    conn, connector = decode_worker(store.address)
    try:
        load = GroupLoad("d", tokens, TABLES, 0, PAGES, handoff_id=handoff_id, handoff_wait_s=30.0)
        connector.worker.receives.start(None, load)  # type: ignore[union-attr]  # as start_loads with no client
        done, failed, deadline = set(), set(), time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            done, failed, _ = engine_step(connector, KVStoreConnectorMetadata(num_scheduled_tokens=0))
        assert done == {"d"} and not failed, (done, failed)
    finally:
        connector.worker.shutdown()  # type: ignore[union-attr]
        conn.close()
