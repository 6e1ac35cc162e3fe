"""A single-group decode aborted while it waits for its handoff is reported in the step vLLM names
it (pd_worker.py, DESIGN §12.7), as a hybrid one is. Written by an adversarial review of 95563ed,
where the single-group decode worker still ignored ``finished_req_ids`` for its receives: vLLM's Scheduler.finish_requests keeps an
aborted WAITING_FOR_REMOTE_KVS request's blocks until the connector reports it in
finished_recving, and HandoffWorker reports it only when its wait ends (deadline + 5 s). And a decode
aborted before vLLM scheduled it lets its node go of the handoff (pd.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from support.servers import ServerProcess
from test_vllm_connector_parts import store_process  # noqa: F401  # the fixture
from test_vllm_pd_receive import (
    BLOCK,
    BLOCK_IDS,
    DIM,
    HEADS,
    LAYERS,
    NAMESPACE,
    PAGES,
    assert_no_lease_left,
    caches,
    handed_off,
    num_leases,
)

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.metadata import HandoffLoad, KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.pd import HandoffScheduler
from kvstore.client.adapters.vllm.pd_worker import HandoffWorker
from kvstore.client.adapters.vllm.scheduler import SchedulerSide
from kvstore.client.handoff import new_handoff_id


def test_an_aborted_single_group_decode_is_reported_so_that_vllm_frees_its_blocks(store_process: ServerProcess) -> None:  # noqa: F811
    tokens = list(range(1, PAGES * BLOCK + 1))
    store = StoreConnection(store_process.address, NAMESPACE)
    assert store.start()
    worker = HandoffWorker(store, BLOCK, 5.0, 10.0, push_layers=False)
    worker.register(caches(shared=True))
    try:
        # a decode whose prefill has not completed (its client went away: the proxy aborts the decode)
        load = HandoffLoad("d", new_handoff_id(), tokens, BLOCK_IDS, 0, PAGES, deadline_s=600.0)
        worker.begin_step(KVStoreConnectorMetadata(handoff_loads=[load], num_scheduled_tokens=5))
        assert worker.finished(set(), set()) == (set(), set())
        reported, aborted, deadline = set(), {"d"}, time.monotonic() + 5
        while "d" not in reported and time.monotonic() < deadline:
            worker.begin_step(KVStoreConnectorMetadata(num_scheduled_tokens=5))
            reported |= worker.finished(set(), aborted)[1]  # the step after the abort names it in finished_req_ids
            aborted = set()
            time.sleep(0.05)
        assert "d" in reported, ("5 s after its abort the single-group decode was not reported finished receiving: "
                                 "vLLM holds its blocks until its wait ends (600 s + 5 s)")
    finally:
        worker.shutdown()
        store.close()


def test_a_decode_aborted_before_it_was_scheduled_lets_its_handoff_go(store_process: ServerProcess) -> None:  # noqa: F811
    """A decode request vLLM finished before it allocated its blocks (aborted while queued: its client
    went away) loads nothing: the pages handed off for it are let go at its node at once, not kept
    pinned until the handoff's ttl (30 s here). Before, they were."""
    tokens = list(range(1, PAGES * BLOCK + 1))
    handoff_id = handed_off(store_process.address, tokens, torch.randn(LAYERS, 2, len(tokens), HEADS, DIM))
    assert num_leases(store_process.address) >= 1, "the marker pins the handed-off pages"
    store = StoreConnection(store_process.address, NAMESPACE)
    assert store.start()
    try:
        handoffs = HandoffScheduler(SchedulerSide(store, BLOCK, lookup_timeout_s=5.0), deadline_s=10.0, ttl_s=30.0)
        params = {"do_remote_prefill": True, "do_remote_decode": False, "kvstore_handoff_id": handoff_id,
                  "kvstore_num_tokens": len(tokens)}
        prompt = [*tokens, 7]
        request = SimpleNamespace(request_id="d", prompt_token_ids=prompt, all_token_ids=list(prompt), kv_transfer_params=params,
                                  status=SimpleNamespace(name="WAITING"), num_computed_tokens=0)
        assert handoffs.matched(request, 0) == (len(tokens), True)
        request.status = SimpleNamespace(name="FINISHED_ABORTED")  # never allocated: no load was planned
        assert handoffs.finished(request, saving=False) == (False, None)
        assert_no_lease_left(store_process.address, within_s=5.0)
    finally:
        store.close()
