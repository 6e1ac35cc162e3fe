"""Review of the stale-request change (test_vllm_stale_requests.py): a request a save of which
was refused as stale must not send a page again at its finish either (worker.py's save again,
resave.py). A chunked prefill plans its second chunk's save before its first chunk's refusal is
reported; when that second save ends short for another reason (the connection broke mid-step),
it was recorded as unsaved after the refusal had forgotten the request, so the finished request
copied its pages out once more and sent them, to be refused again, while vLLM held its blocks.
Real kvstore-server process, the connector's two sides without an engine."""

from __future__ import annotations

import time
from types import SimpleNamespace

from support.servers import ServerProcess
from test_vllm_connector_parts import BLOCK, NAMES, break_connection, hand_back, new_request, parts, reconnected
from test_vllm_save_generation import _invalidate

from kvstore.client.adapters.vllm.metadata import KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.scheduler import SchedulerSide


def _chunk(scheduler: SchedulerSide, req_id: str, blocks: list[int], computed: int, scheduled: int) -> KVStoreConnectorMetadata:
    """A step of a chunked prefill: the first chunk new, the next one cached."""
    first = computed == 0
    new = [SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=0)] if first else []
    cached = SimpleNamespace(req_ids=[] if first else [req_id], resumed_req_ids=set(), new_block_ids=[] if first else [None],
                             num_computed_tokens=[] if first else [computed])
    return scheduler.build_meta(SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                                                num_scheduled_tokens={req_id: scheduled}, preempted_req_ids=None))


def test_a_stale_request_sends_nothing_again_at_its_finish(store_process: ServerProcess) -> None:
    tokens = list(range(40, 40 + 4 * BLOCK + 1))
    store, scheduler, worker, caches = parts(store_process.address, use_shm=False)
    request = new_request("r", tokens)
    assert scheduler.num_new_matched_tokens(request, 0) == 0
    scheduler.after_alloc(request, 0)
    first = _chunk(scheduler, "r", list(range(5)), 0, 2 * BLOCK)
    assert [(s.first_page, len(s.tokens) // BLOCK) for s in first.saves] == [(0, 2)]
    assert _invalidate(store_process.address, store.namespace) == 1
    worker.begin_step(first)
    worker.start_loads(first)
    for i, name in enumerate(NAMES):
        caches[name].fill_(3.0 + i)
        worker.save_layer(name)
    worker.end_step()
    assert worker.wait_saves(10)  # refused at the store; the workers report it after the next step
    second = _chunk(scheduler, "r", list(range(5)), 2 * BLOCK, 2 * BLOCK + 1)
    assert [(s.first_page, len(s.tokens) // BLOCK) for s in second.saves] == [(2, 4)]
    worker.begin_step(second)
    worker.start_loads(second)
    break_connection(store, "test: the connection broke mid-step")  # the save (streamed) fails before its first page is sent
    for i, name in enumerate(NAMES):
        caches[name].fill_(4.0 + i)
        worker.save_layer(name)
    worker.end_step()
    assert worker.wait_saves(10)
    hand_back(worker, scheduler)
    assert scheduler.requests["r"].stale and worker.stats.saves_stale == 1
    reconnected(store)  # a save again could be sent now
    assert scheduler.finished(request)  # a save was scheduled: vLLM holds its blocks until it is reported
    done: set[str] = set()
    deadline = time.monotonic() + 10
    while not done:
        done = hand_back(worker, scheduler, {"r"} if not done else set())
        assert time.monotonic() < deadline, "the finished request was never reported: its blocks stay held"
        worker.wait_saves(1)
    assert done == {"r"}
    assert worker.stats.saves_again == 0 and worker.stats.saves_stale == 1, \
        f"the stale request's pages were sent again at its finish: {worker.stats}"
    assert not scheduler.holds_blocks
    store.close()
