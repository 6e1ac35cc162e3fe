"""A vLLM request whose save the server refused as stale (invalidated since its lookup, DESIGN §3)
sends none of its later pages: they name the same generation and would each be refused. The
workers report it (``KVStoreWorkerMetadata.stale``), not as a save that came up short, and the
scheduler side plans no more saves for it. Both connectors: the single-group one and the hybrid
one (which, before, sent the whole refused save again on every step). Real kvstore-server
processes, the connector's two sides without an engine (test_vllm_connector_parts.py)."""

from __future__ import annotations

from types import SimpleNamespace

import test_vllm_hybrid_load_costs as hybrid
from support.servers import ServerProcess
from test_vllm_connector_parts import BLOCK, cached_step, forward, hand_back, parts, step
from test_vllm_save_generation import _invalidate

from kvstore.client.adapters.vllm.hybrid_scheduler import HybridSchedulerSide


def test_a_request_refused_as_stale_sends_none_of_its_later_pages(store_process: ServerProcess) -> None:
    """Bug: each page the request computed after the refusal was planned, copied out and sent
    once, and refused (saves_stale counted each)."""
    tokens = list(range(1, 3 * BLOCK + 2))
    store, scheduler, worker, caches = parts(store_process.address)
    meta = step(scheduler, "r", tokens, 0, list(range(6)))
    assert [(s.first_page, len(s.tokens) // BLOCK) for s in meta.saves] == [(0, 3)]
    assert _invalidate(store_process.address, store.namespace) == 1
    forward(worker, meta, fill=3.0, caches=caches)
    assert worker.wait_saves(10)
    hand_back(worker, scheduler)
    assert worker.stats.saves_stale == 1
    for computed in range(len(tokens), 5 * BLOCK + 1):  # decode steps completing the fourth and the fifth page
        scheduler.requests["r"].request.all_token_ids.append(5)
        meta = cached_step(scheduler, "r", computed, 1)
        assert not meta.saves, f"a page of the stale request was sent at {computed} tokens: {meta.saves}"
        forward(worker, meta, fill=3.0, caches=caches)
        hand_back(worker, scheduler)
    assert worker.stats.saves_stale == 1 and worker.stats.saves_started == 1
    scheduler.finished(scheduler.requests["r"].request)
    assert hand_back(worker, scheduler, {"r"}) == {"r"} and worker.stats.saves_again == 0
    store.close()


def _hybrid_step(scheduler: HybridSchedulerSide, req_id: str, tables: tuple[list[int], ...], computed: int,
                 scheduled: int) -> object:
    new = [SimpleNamespace(req_id=req_id, block_ids=tables, num_computed_tokens=0)] if computed == 0 else []
    cached = SimpleNamespace(req_ids=[req_id] if computed else [], resumed_req_ids=set(), new_block_ids=[None] if computed else [],
                             num_computed_tokens=[computed] if computed else [])
    return scheduler.build_meta(SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                                                num_scheduled_tokens={req_id: scheduled}, preempted_req_ids=None,
                                                finished_req_ids=set()))


def test_a_hybrid_request_refused_as_stale_is_not_sent_again(store_process: ServerProcess) -> None:
    """Bug: the hybrid worker counted a stale refusal as a failed save that stored nothing, so
    the scheduler side planned the whole save again on the next step, refused again, on every
    step of the request (each a copy of its pages out of vLLM's blocks and a put)."""
    conn, worker, _ = hybrid.worker(store_process.address)
    groups = SimpleNamespace(spec=SimpleNamespace(block_size=hybrid.BLOCK), groups=[SimpleNamespace(index=0),
                                                                                     SimpleNamespace(index=1)],
                             state_groups=[])
    tables = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
    scheduler = HybridSchedulerSide(conn, groups, 5.0, lambda req_id: tables)  # type: ignore[arg-type]
    p = hybrid.BLOCK
    tokens = [2000 + t for t in range(hybrid.PAGES * p + 1)]
    request = SimpleNamespace(request_id="r", prompt_token_ids=tokens, all_token_ids=list(tokens), kv_transfer_params=None)
    assert scheduler.num_new_matched_tokens(request, 0) == 0  # looked up in generation 0
    scheduler.after_alloc(request, 0)
    meta = _hybrid_step(scheduler, "r", tables, 0, len(tokens))
    assert meta.group_saves and meta.group_saves[0].generation == 0  # type: ignore[attr-defined]
    assert _invalidate(store_process.address, conn.namespace) == 1
    hybrid.step(worker, meta)  # type: ignore[arg-type]
    assert worker.wait_saves(10)
    report = worker.report()
    assert report is not None and "r" not in report.stored_pages and report.stale == {"r"}
    assert worker.stats.saves_stale == 1 and worker.stats.saves_failed == 0 and worker.stats.saved_tokens == 0
    scheduler.saves_short(report)  # what the connector does with the workers' report
    for computed in range(len(tokens), (hybrid.PAGES + 1) * p + 1):  # the request decodes past another page
        request.all_token_ids.append(5)
        meta = _hybrid_step(scheduler, "r", tables, computed, 1)
        assert not meta.group_saves, f"the stale request was sent again at {computed} tokens"  # type: ignore[attr-defined]
        hybrid.step(worker, meta)  # type: ignore[arg-type]
        scheduler.saves_short(worker.report())
    assert worker.stats.saves_started == 1
    scheduler.finished(request)
    conn.close()
