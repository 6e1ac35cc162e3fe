"""Disaggregated prefill's connector sides under a review's cases: the decode worker's receive
(pd_worker.py, pd_leases.py) at the connector's shutdown, as KVStoreConnector.shutdown runs it
(the handoff worker shut down, then the store connection closed at once: what a receive leased
must be back at the node then, not left to its lease's ttl; a real kvstore-server process, as
test_vllm_pd_receive.py), and kv_transfer_params a request's sender got wrong (pd.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from test_vllm_connector_parts import store_process
from test_vllm_pd_receive import BLOCK, NAMESPACE, assert_no_lease_left, job_done, num_leases, server, start

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.metadata import KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.pd import HandoffScheduler
from kvstore.client.adapters.vllm.scheduler import SchedulerSide

__all__ = ["server", "store_process"]  # the fixtures, used by name (server asks for store_process)


def test_a_connector_shut_down_with_a_receive_not_landed_leaves_no_lease(server) -> None:
    store, worker, _, _, _ = start(server.address, shared=True)
    try:
        job_done(worker)
        assert worker._receiving[0].taken is not None and num_leases(server.address) > 0
        worker.shutdown()
        store.close()
        assert_no_lease_left(server.address, within_s=5.0)  # the leases' ttl is 30 s
    finally:
        store.close()


@pytest.mark.parametrize("params", [
    {"kvstore_num_tokens": "abc"}, {"kvstore_num_tokens": [1]}, {"kvstore_num_tokens": "inf"}, {"kvstore_deadline_s": "x"},
    {"kvstore_deadline_s": [2]}, {"kvstore_deadline_s": "inf"}, {"kvstore_deadline_s": "nan"}, {"kvstore_deadline_s": -5},
    {"kvstore_deadline_s": 1e9},
], ids=str)
def test_a_decodes_malformed_transfer_params_are_not_raised_into_vllm(params: dict[str, Any]) -> None:
    """``kv_transfer_params`` come from whoever sends the request (vLLM's API takes them from the
    body): a count or a deadline that is not a number raised ValueError or TypeError out of
    get_num_new_matched_tokens, into vLLM's scheduler (the engine dies). A malformed count is no
    handoff (the request is served as any request); a deadline that is not a finite number above
    0 is the configured one, and one past a handoff's longest wait (600 s) is that."""
    handoffs = scheduler()
    try:
        req = decode_request(params)
        found = handoffs.matched(req, 0)
        if "kvstore_num_tokens" in params:
            assert found is None
            return
        assert found == (3 * BLOCK, True)
        handoffs.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 3 * BLOCK)
        (load,) = handoffs.add_to(KVStoreConnectorMetadata()).handoff_loads
        assert load.deadline_s == (600.0 if params["kvstore_deadline_s"] == 1e9 else 10.0)
    finally:
        handoffs.scheduler.store.close()


@pytest.mark.parametrize("node", [{"a": 1}, 5, ["n2"]], ids=str)
def test_a_prefills_decode_node_that_is_not_a_name_hands_off_through_the_pool(node: object) -> None:
    """A ``kvstore_decode_node`` that is not a string reached the worker's handoff_open, whose
    request could not be built: TypeError out of bind_connector_metadata, into vLLM's worker."""
    handoffs = scheduler()
    try:
        req = SimpleNamespace(request_id="p", prompt_token_ids=list(range(1, 129)), all_token_ids=list(range(1, 129)),
                              kv_transfer_params={"do_remote_decode": True, "kvstore_decode_node": node},
                              status=SimpleNamespace(name="RUNNING"), num_computed_tokens=0)
        assert handoffs.matched(req, 0) is None
        handoffs.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)
        (opened,) = handoffs.add_to(KVStoreConnectorMetadata()).handoff_opens
        assert opened.to_node is None
    finally:
        handoffs.scheduler.store.close()


def scheduler() -> HandoffScheduler:
    """The scheduler side's handoffs on a store that cannot connect (these decisions take no call)."""
    store = StoreConnection("127.0.0.1:1", NAMESPACE, connect_timeout_s=0.1)
    return HandoffScheduler(SchedulerSide(store, BLOCK, lookup_timeout_s=0.1), deadline_s=10.0, ttl_s=30.0)


def decode_request(extra: dict[str, Any]) -> SimpleNamespace:
    params = {"do_remote_prefill": True, "kvstore_handoff_id": "ab" * 16, "kvstore_num_tokens": 128, **extra}
    return SimpleNamespace(request_id="d", prompt_token_ids=list(range(1, 129)), all_token_ids=list(range(1, 129)),
                           kv_transfer_params=params, status=SimpleNamespace(name="RUNNING"), num_computed_tokens=0)
