"""A lease the vLLM scheduler's client took is read by the worker's client (two processes in
vLLM, each with its own client): after the server restarted, the lease names the arena its
offsets are in, and a worker whose client maps another does not copy through it (it loads
layer-wise, which maps the new arena). Found by a review of 3158aa2: every leased load failed
its checksum and was recomputed until the worker's client happened to remap."""

from __future__ import annotations

from support.servers import ServerProcess
from test_vllm_connector_parts import NAMES, forward, parts, step, store_prompt


def test_a_worker_reads_a_lease_of_the_restarted_server(store_process: ServerProcess) -> None:
    tokens = list(range(1, 4 * 32 + 2))
    # a generous load deadline: the load maps the new arena first (the prior-based 50 ms failed under load)
    worker_store, _, worker, caches = parts(store_process.address, sync_load_pages=4, load_deadline_s=30)  # the worker process's client
    assert worker_store.client().shared_memory
    store_process.kill()
    store_process.start()
    store_prompt(store_process.address, list(range(5000, 5000 + 4 * 32 + 1)))  # other pages first: other offsets
    store_prompt(store_process.address, tokens)
    sched_store, scheduler, _, _ = parts(store_process.address)  # the scheduler process's client
    meta = step(scheduler, "reader", tokens, 0, [10, 11, 12, 13, 14])
    assert [(s.first_page, s.num_pages) for s in meta.loads] == [(0, 4)] and meta.loads[0].lease is not None
    forward(worker, meta)
    try:
        assert worker.load_errors() == set(), "the leased copy read the new server's offsets through the old mapping"
        assert all(bool((caches[name][10:14] == 1.0 + i).all()) for i, name in enumerate(NAMES))
    finally:
        worker_store.close()
        sched_store.close()
