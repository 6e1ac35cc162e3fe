"""A vLLM request's saves name the namespace generation its lookup saw (DESIGN §3): KV an
engine computed on a prefix it looked up before an acknowledged invalidation never lands in
the new generation, whichever way the lookup went (a same-host lease or a plain lookup) and
whether or not it hit. Real kvstore-server processes, the connector's two sides without an
engine (test_vllm_connector_parts.py)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import test_vllm_hybrid_load_costs as hybrid
import torch
from support.servers import ServerProcess
from test_vllm_connector_parts import BLOCK, cached_step, forward, hand_back, new_request, parts, step, store_prompt

from kvstore import Namespace
from kvstore.client import KVStoreClient
from kvstore.client.adapters.vllm.metadata import GroupSave, KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.pd import HandoffScheduler
from kvstore.client.adapters.vllm.scheduler import SchedulerSide
from kvstore.client.adapters.vllm.worker import WorkerSide


def _invalidate(store_address: str, namespace: Namespace) -> int:
    """An acknowledged invalidation, from another client (the operator's)."""
    async def go() -> int:
        client = KVStoreClient(store_address, namespace)
        await client.connect()
        try:
            return await client.invalidate()
        finally:
            await client.close()
    return asyncio.run(go())


def _saved(worker: WorkerSide, scheduler: SchedulerSide, req_id: str) -> None:
    deadline = time.monotonic() + 10
    while req_id not in hand_back(worker, scheduler, {req_id}):
        assert time.monotonic() < deadline, "the save did not end"
        time.sleep(0.01)


@pytest.mark.parametrize("use_shm", [True, False], ids=["lease", "lookup"])
@pytest.mark.parametrize("hit", [True, False], ids=["hit", "miss"])
def test_a_save_of_kv_looked_up_before_an_invalidation_is_refused(store_process: ServerProcess, use_shm: bool,
                                                                   hit: bool) -> None:
    prefix = list(range(1, 2 * BLOCK + 1))
    tokens = prefix + list(range(900, 900 + 2 * BLOCK + 1))
    if hit:
        store_prompt(store_process.address, prefix + [7])
    store, scheduler, worker, caches = parts(store_process.address, use_shm=use_shm)
    client = store.client()
    assert client is not None and client.shared_memory == use_shm
    meta = step(scheduler, "r", tokens, 0, list(range(5)))
    assert meta.saves and len(meta.loads) == int(hit)
    assert _invalidate(store_process.address, store.namespace) == 1  # acknowledged: every later read sees generation 1
    forward(worker, meta, fill=3.0, caches=caches)  # the engine computes on what it looked up, then saves
    _saved(worker, scheduler, "r")
    assert store.run(client, client.lookup(tokens), 5).num_pages == 0, \
        "KV computed on a lookup of generation 0 was stored in generation 1, after its invalidation was acknowledged"
    assert worker.stats.saved_tokens == 0
    store.close()


def test_a_save_after_a_lookup_in_the_current_generation_is_stored(store_process: ServerProcess) -> None:
    """The same steps with the invalidation before the lookup: the save names generation 1 and is stored."""
    tokens = list(range(1, 3 * BLOCK + 2))
    store, scheduler, worker, caches = parts(store_process.address)
    assert _invalidate(store_process.address, store.namespace) == 1
    meta = step(scheduler, "r", tokens, 0, list(range(4)))
    forward(worker, meta, fill=3.0, caches=caches)
    _saved(worker, scheduler, "r")
    client = store.client()
    assert client is not None
    hit = store.run(client, client.lookup(tokens), 5)
    assert (hit.num_pages, hit.generation) == (3, 1)
    store.close()


@pytest.mark.parametrize("named", [0, 1])
def test_a_hybrid_engines_page_puts_name_the_generation_of_its_lookup(store_process: ServerProcess, named: int) -> None:
    """The hybrid worker's puts name the GroupSave's generation (the scheduler side's lookup,
    ``stored_prefix``): after an invalidation to 1, a save computed in 0 stores nothing and one
    computed in 1 is stored."""
    tokens = list(range(1, hybrid.PAGES * hybrid.BLOCK + 1))
    conn, side, caches = hybrid.worker(store_process.address)
    client = conn.client()
    assert client is not None
    assert conn.stored_prefix(client, client.keys(tokens), 5) == (0, 0)
    assert _invalidate(store_process.address, conn.namespace) == 1
    for i, name in enumerate(hybrid.NAMES):
        caches[name].copy_(torch.randn_like(caches[name]) + i)
    save = GroupSave("w", tokens, ([1, 2, 3, 4], [5, 6, 7, 8]), 0, generation=named)
    hybrid.step(side, KVStoreConnectorMetadata(group_saves=[save], num_scheduled_tokens=len(tokens), num_prefill_tokens=len(tokens)))
    assert side.wait_saves(10)
    assert conn.stored_prefix(client, client.keys(tokens), 5) == ((hybrid.PAGES, 1) if named == 1 else (0, 1))
    assert client.generation_seen == 1
    conn.close()


@pytest.mark.parametrize(("named", "stored"), [(0, 0), (1, 4), ("1", 4)], ids=["prefills-generation", "current", "malformed"])
def test_a_decode_saves_in_the_generation_its_prefill_computed_in(store_process: ServerProcess, named: object,
                                                                  stored: int) -> None:
    """A decode's request names the prefill's generation (``kvstore_generation`` in its kv_transfer_params,
    test_vllm_pd_parts.py shows the prefill side handing it): KV computed on a handoff of generation 0 is
    not saved once 1 was acknowledged; a malformed one is logged and the decode asks the store instead."""
    store, scheduler, worker, caches = parts(store_process.address)
    handoffs = HandoffScheduler(scheduler, deadline_s=1.0, ttl_s=30.0)
    assert _invalidate(store_process.address, store.namespace) == 1
    tokens = list(range(1, 4 * BLOCK + 2))
    request = new_request("d", tokens)
    request.kv_transfer_params = {"do_remote_prefill": True, "do_remote_decode": False, "kvstore_handoff_id": "ab" * 16,
                                  "kvstore_num_tokens": 4 * BLOCK, "kvstore_generation": named}
    assert handoffs.matched(request, 0) is not None
    handoffs.after_alloc(request, SimpleNamespace(get_block_ids=lambda: (list(range(5)),)), 0)  # the decode recomputes it
    meta = scheduler.build_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="d", block_ids=(list(range(5)),), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={"d": len(tokens)}, preempted_req_ids=None))
    assert meta.saves and meta.saves[0].generation == (named if isinstance(named, int) else 1)
    forward(worker, meta, fill=2.0, caches=caches)
    _saved(worker, scheduler, "d")
    client = store.client()
    assert client is not None
    assert store.run(client, client.lookup(tokens), 5).num_pages == stored
    store.close()


def test_a_save_refused_as_stale_is_not_sent_again(store_process: ServerProcess) -> None:
    """Bug: a save the server refused for its stale generation counted as a save that came up short,
    so the request's next step sent the same save again, refused again, on every step until it
    finished (and once more at its end). It ends as a save a session fence refused: never sent again."""
    tokens = list(range(1, 3 * BLOCK + 2))
    store, scheduler, worker, caches = parts(store_process.address)
    meta = step(scheduler, "r", tokens, 0, list(range(4)))
    assert [(s.first_page, len(s.tokens) // BLOCK, s.generation) for s in meta.saves] == [(0, 3, 0)]
    assert _invalidate(store_process.address, store.namespace) == 1
    forward(worker, meta, fill=3.0, caches=caches)
    assert worker.wait_saves(10)
    hand_back(worker, scheduler)
    assert worker.stats.saves_stale == 1 and worker.stats.saved_tokens == 0
    for computed in range(len(tokens), len(tokens) + 3):  # decode steps, still within the fourth page
        scheduler.requests["r"].request.all_token_ids.append(5)
        meta = cached_step(scheduler, "r", computed, 1)
        assert not meta.saves, f"the refused save was sent again: {meta.saves}"
        forward(worker, meta, fill=3.0, caches=caches)
        hand_back(worker, scheduler)
    scheduler.finished(scheduler.requests["r"].request)
    assert hand_back(worker, scheduler, {"r"}) == {"r"} and worker.stats.saves_again == 0  # nothing to save at its end
    store.close()
