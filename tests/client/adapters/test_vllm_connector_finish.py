"""The save of a request's last step, when that save ends short: the connector's scheduler
and worker sides without an engine (the parts of test_vllm_connector_parts), a real
kvstore-server process, vLLM's own block layout on CPU."""

from __future__ import annotations

import time

import torch
from support.servers import ServerProcess
from test_vllm_connector_parts import (
    BLOCK,
    LAYOUT,
    NAMES,
    cached_step,
    forward,
    hand_back,
    new_request,
    parts,
    step,
    store_process,
)

from kvstore.client.adapters.vllm.worker import WorkerSide
from kvstore.errors import KVStoreError

__all__ = ["store_process"]  # the fixture, used by name


def test_the_last_steps_save_that_ended_short_is_saved_again(store_process: ServerProcess) -> None:
    """Regression: a page of the answer completed in a request's last
    decode step is saved in that step; a save that ended short was to be re-done "in the
    request's next step", which a finished request does not have: the worker reported the
    request finished at once (vLLM freed its blocks) and the page was never stored. Now the
    worker saves it again while vLLM still holds the blocks (request_finished said True),
    and reports the request once that save ended."""
    store, scheduler, worker, caches = parts(store_process.address)
    prompt = list(range(11, 11 + 2 * BLOCK + 1))
    request = new_request("r", prompt)
    forward(worker, step(scheduler, "r", prompt, 0, [0, 1, 2], request=request), fill=3.0, caches=caches)
    assert worker.wait_saves(10)
    hand_back(worker, scheduler)
    request.all_token_ids.extend(range(900, 900 + BLOCK - 1))  # the answer so far: page 2 lacks its last token's KV
    last = cached_step(scheduler, "r", 3 * BLOCK - 1, 1)  # the last decode step computes it
    assert [(s.first_page, len(s.tokens) // BLOCK) for s in last.saves] == [(2, 3)]
    worker.begin_step(last)
    worker.start_loads(last)
    client = store.client()
    assert client is not None
    closing = store.failed(client, KVStoreError("test: the connection broke in the request's last step"))
    assert closing is not None
    closing.join(10)  # the step's save is abandoned: it ends short
    forward_layers(worker, caches, 7.0)
    worker.end_step()
    assert scheduler.finished(request) is True, "vLLM must keep the blocks while a save may read them"
    reported: set[str] = set()
    finished = {"r"}  # vLLM passes a finished request once, then steps on while blocks are held
    deadline = time.monotonic() + 20
    while not reported:
        assert time.monotonic() < deadline, "the finished request was never reported"
        reported, finished = hand_back(worker, scheduler, finished), set()
        time.sleep(0.02)
    assert reported == {"r"} and not scheduler.holds_blocks
    while (reader := store.client()) is None:  # reconnects after retry_s
        assert time.monotonic() < deadline, "no reconnection"
        time.sleep(0.05)
    answer = list(request.all_token_ids)
    hit = store.run(reader, reader.lookup(answer), 5)
    assert hit.num_pages == 3, "the page completed in the last step was not saved"
    kv = torch.zeros(LAYOUT.num_layers, 2, 3 * BLOCK, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    store.run(reader, reader.get(hit, into=kv), 5)
    for layer in range(LAYOUT.num_layers):  # the KV of the last step, as vLLM's blocks held it
        assert bool((kv[layer, :, 2 * BLOCK :] == 7.0 + layer).all())
    store.close()


def forward_layers(worker: WorkerSide, caches: dict[str, torch.Tensor], fill: float) -> None:
    """The model computes every layer (writing ``fill + layer`` into every block) and hands it to the saves."""
    for i, name in enumerate(NAMES):
        worker.wait_layer(name)
        caches[name].fill_(fill + i)
        worker.save_layer(name)
