"""The prefill worker's completion of a handoff in the background (client/adapters/vllm/pd_worker.py,
DESIGN §12.7) without an engine: a real kvstore-server process, a real StoreConnection. The
request is reported finished sending once its saves ended; its Complete runs on the client's
runtime after its open and is counted as it ends. What the engines cannot be steered into: a
Complete given up on, a worker shut down with one in flight, an open that outlives its
``open_timeout_s`` on an engine that steps no more, a client closed under the step."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest
import torch
from support.servers import ServerProcess
from test_vllm_connector_parts import store_process  # noqa: F401  # the fixture

from kvstore import KVLayout, Namespace
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.metadata import HandoffComplete, HandoffOpen, KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.pd_worker import HandoffWorker
from kvstore.client.client import KVStoreClient
from kvstore.client.handoff import new_handoff_id

BLOCK, HEADS, DIM, LAYERS, PAGES = 32, 2, 16, 2, 2
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, page_tokens=BLOCK)
NAMESPACE = Namespace(model="pd-complete", revision="r", layout=LAYOUT)
TOKENS = list(range(1, PAGES * BLOCK + 1))


def connected(address: str) -> tuple[StoreConnection, KVStoreClient]:
    store = StoreConnection(address, NAMESPACE)
    assert store.start()
    client = store.client()
    assert client is not None
    return store, client


def counted(worker: HandoffWorker, within_s: float = 20.0) -> None:
    """Waits until no completion is in flight (the runtime's thread counts them as they end)."""
    assert worker.wait_completions(within_s), "a completion was never counted"
    assert worker.completions_in_flight() == 0


def completes(handoff_id: str = "") -> KVStoreConnectorMetadata:
    return KVStoreConnectorMetadata(handoff_completes=[HandoffComplete("r1", handoff_id or new_handoff_id(), None, TOKENS)])


@pytest.mark.parametrize("ended_by", ["given-up", "shut-down"])
def test_a_completion_given_up_on_or_cut_by_shutdown_keeps_the_stores_connection(store_process: ServerProcess,  # noqa: F811
                                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                                  ended_by: str) -> None:
    """Bug: a Complete given up on past its deadline (or cancelled by the worker's shutdown) ended
    its job with the runtime's plain KVStoreError "the operation was cancelled", which the
    done-callback took for a transport failure: StoreConnection.failed dropped and closed the
    client, cancelling every save and receive it carried. Before the completion ran in the
    background, a Complete given up on was counted failed and the connection kept."""
    store, client = connected(store_process.address)

    async def hung(*args: object, **kwargs: object) -> int:
        await asyncio.sleep(60)
        return 0

    monkeypatch.setattr(client, "handoff_complete", hung)
    worker = HandoffWorker(store, BLOCK, open_timeout_s=2.0, complete_timeout_s=5.0)
    try:
        worker.begin_step(completes())
        assert worker.finished(set(), {"r1"})[0] == {"r1"}
        assert worker.completions_in_flight() == 1
        if ended_by == "given-up":
            worker._completing["r1"].give_up_at = 0.0
            assert worker.finished(set(), set())[0] == set()
        else:
            worker.shutdown()
        counted(worker)
        assert worker.stats.complete_failed == 1 and worker.stats.completed == 0
        assert store.client() is client, "the connection was dropped for a completion it gave up on"
    finally:
        worker.shutdown()
        store.close()


def test_a_completion_never_reaches_the_node_before_an_open_that_outlived_its_timeout(store_process: ServerProcess,  # noqa: F811
                                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: the completion waited ``open_timeout_s`` for the open, then sent Complete with the open
    still running: only a later step's _settle_opens cancelled it, and an engine that had reported
    the request finished sending may never step again. The open then landed after the Complete
    (and stays registered at the node until its ttl). Past its timeout the open is cancelled and
    its unwinding waited for before Complete is sent; it is counted failed, the connection kept."""
    store, client = connected(store_process.address)
    landed: list[str] = []
    real_open, real_complete = client.handoff_open, client.handoff_complete

    async def slow_open(*args: object, **kwargs: object) -> None:
        await asyncio.sleep(1.0)
        await real_open(*args, **kwargs)  # type: ignore[arg-type]
        landed.append("open")

    async def complete(*args: object, **kwargs: object) -> int:
        n = await real_complete(*args, **kwargs)  # type: ignore[arg-type]
        landed.append("complete")
        return n

    monkeypatch.setattr(client, "handoff_open", slow_open)
    monkeypatch.setattr(client, "handoff_complete", complete)
    worker = HandoffWorker(store, BLOCK, open_timeout_s=0.2, complete_timeout_s=5.0)
    handoff_id = new_handoff_id()
    try:
        worker.begin_step(KVStoreConnectorMetadata(handoff_opens=[HandoffOpen("r1", handoff_id, None, 30.0, TOKENS)]))
        worker.begin_step(completes(handoff_id))
        assert worker.finished({"r1"}, {"r1"})[0] == {"r1"}
        counted(worker)  # the engine steps no more: nothing but the runtime ends the open
        time.sleep(1.5)  # past the open's sleep: an open not cancelled lands now
        assert landed == ["complete"], f"the open landed after the Complete: {landed}"
        worker.finished(set(), set())  # a later step counts the open given up on
        assert worker.stats.open_failed == 1 and worker.stats.opened == 0
        assert store.client() is client, "the connection was dropped for an open given up on"
    finally:
        worker.shutdown()
        store.close()


def test_an_open_that_failed_while_the_completion_waited_logs_no_unretrieved_exception(
        store_process: ServerProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """The completion awaits the open's end through an asyncio future it must read: a failed open
    otherwise logged asyncio's "Future exception was never retrieved" (an ERROR) on the runtime."""
    from kvstore.errors import LimitExceeded

    store, client = connected(store_process.address)

    async def refused_open(*args: object, **kwargs: object) -> None:
        await asyncio.sleep(0.3)
        raise LimitExceeded("too many open handoffs")

    monkeypatch.setattr(client, "handoff_open", refused_open)
    worker = HandoffWorker(store, BLOCK, open_timeout_s=5.0, complete_timeout_s=5.0)
    handoff_id = new_handoff_id()
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            worker.begin_step(KVStoreConnectorMetadata(handoff_opens=[HandoffOpen("r1", handoff_id, None, 30.0, TOKENS)]))
            worker.begin_step(completes(handoff_id))
            assert worker.finished({"r1"}, {"r1"})[0] == {"r1"}
            counted(worker)
            worker.finished(set(), set())  # a later step counts the open, and lets go of it
            gc.collect()
        assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
        assert worker.stats.open_failed == 1
    finally:
        worker.shutdown()
        store.close()


def test_a_completion_whose_client_closed_under_the_step_raises_nothing_and_is_counted(
        store_process: ServerProcess) -> None:  # noqa: F811
    """The runtime's thread drops a client (a completion's failure: StoreConnection.failed) while
    the step had just taken it: the submit to its closed runtime raised KVStoreError into vLLM's
    get_finished, and the completion, counted in flight before it, stayed so for ever (the test
    harnesses' drain then waits out its whole bound). It is counted failed."""
    store, client = connected(store_process.address)
    worker = HandoffWorker(store, BLOCK, open_timeout_s=2.0, complete_timeout_s=5.0)
    try:
        client.runtime.close()  # closed, and still the connection's client: the step's race
        worker.begin_step(completes())
        assert worker.finished(set(), {"r1"})[0] == {"r1"}
        assert worker.completions_in_flight() == 0
        assert worker.stats.complete_failed == 1
    finally:
        worker.shutdown()
        store.close()
