"""A single-group decode aborted while it waits for its handoff is reported in the step vLLM names
it (pd_worker.py, DESIGN §12.7), as a hybrid one is. Written by an adversarial review of 95563ed,
where the single-group decode worker still ignored ``finished_req_ids`` for its receives: vLLM's Scheduler.finish_requests keeps an
aborted WAITING_FOR_REMOTE_KVS request's blocks until the connector reports it in
finished_recving, and HandoffWorker reports it only when its wait ends (deadline + 5 s)."""

from __future__ import annotations

import time

from support.servers import ServerProcess
from test_vllm_connector_parts import store_process  # noqa: F401  # the fixture
from test_vllm_pd_receive import BLOCK, BLOCK_IDS, NAMESPACE, PAGES, caches

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.metadata import HandoffLoad, KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.pd_worker import HandoffWorker
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
