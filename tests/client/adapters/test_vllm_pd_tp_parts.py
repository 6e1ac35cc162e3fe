"""Disaggregated prefill with tensor parallelism (pd.py, pd_worker.py) without an engine: a real
kvstore-server process (one node: Complete marks the handoff there), one decode scheduler side
in rank 0's namespace (as KVStoreConnector makes it) and a handoff worker per rank of
``tensor_parallel_size`` 2, each in its own namespace, all under the request's one handoff id
(DESIGN §12.7). test_vllm_pd_tp.py runs the same on real TP=2 engines (slower to boot)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import test_vllm_pd_receive as receive
import torch
from support.servers import ServerProcess
from test_vllm_connector_parts import store_process  # noqa: F401  # the fixture

from kvstore import Namespace
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.layout import RequestKV
from kvstore.client.adapters.vllm.metadata import KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.pd import HandoffScheduler
from kvstore.client.adapters.vllm.pd_worker import HandoffWorker
from kvstore.client.adapters.vllm.scheduler import SchedulerSide
from kvstore.client.handoff import new_handoff_id

BLOCK, PAGES, LAYOUT = receive.BLOCK, receive.PAGES, receive.LAYOUT
TP = 2


@pytest.fixture
def server(store_process: ServerProcess) -> ServerProcess:  # noqa: F811  # the imported fixture
    return store_process


def rank_namespace(rank: int) -> Namespace:
    return Namespace(model="pd-tp-parts", revision="r", layout=LAYOUT, tp_rank=rank, tp_size=TP)


def kv_of(num_tokens: int) -> torch.Tensor:
    """A rank's shard of the prompt's KV (random: each rank's differs)."""
    return torch.randn(LAYOUT.num_layers, 2, num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def decode_sides(address: str) -> tuple[list[StoreConnection], HandoffScheduler, list[HandoffWorker]]:
    """The decode engine's connectors: the scheduler's (rank 0's namespace) and a worker's per rank."""
    conns = [StoreConnection(address, rank_namespace(rank)) for rank in range(TP)]
    assert all(conn.start() for conn in conns)
    handoffs = HandoffScheduler(SchedulerSide(conns[0], BLOCK, 5.0, load_when_faster=False), deadline_s=10.0, ttl_s=30.0)
    return conns, handoffs, [HandoffWorker(conn, BLOCK, 2.0, 5.0) for conn in conns]


def decode_request(prompt: list[int], handoff_id: str) -> Any:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "kvstore_handoff_id": handoff_id,
              "kvstore_num_tokens": len(prompt) // BLOCK * BLOCK}
    return SimpleNamespace(request_id="d", prompt_token_ids=prompt, all_token_ids=list(prompt), kv_transfer_params=params,
                           status=SimpleNamespace(name="WAITING"), num_computed_tokens=0)


def close(conns: list[StoreConnection], workers: list[HandoffWorker]) -> None:
    for worker in workers:
        worker.shutdown()
    for conn in conns:
        conn.close()


def test_each_rank_receives_its_own_shard_of_the_one_handoff(server: ServerProcess) -> None:
    """Each rank of the prefill hands off its own shard (other KV) under the request's one id; the
    decode's scheduler plans one load for the request, and each rank's worker waits for its own
    namespace's marker and copies its own shard into its blocks; no pin or lease is left."""
    prompt = list(range(1, PAGES * BLOCK + 2))  # the pages and a token: the hit is every page
    handoff_id = new_handoff_id()
    shards = [kv_of(PAGES * BLOCK) for _ in range(TP)]
    for rank, kv in enumerate(shards):
        receive.handed_off(server.address, prompt[: PAGES * BLOCK], kv, rank_namespace(rank), handoff_id)
    conns, handoffs, workers = decode_sides(server.address)
    try:
        request = decode_request(prompt, handoff_id)
        assert handoffs.matched(request, 0) == (PAGES * BLOCK, True)
        blocks = SimpleNamespace(get_block_ids=lambda: (receive.BLOCK_IDS + [11],))
        assert handoffs.after_alloc(request, blocks, PAGES * BLOCK)
        meta = handoffs.add_to(KVStoreConnectorMetadata())
        for worker in workers:
            worker.register(receive.caches(shared=True))
            worker.begin_step(meta)
        for worker, kv in zip(workers, shards):
            assert receive.settle(worker) == {"d"} and worker.load_errors() == set()
            got = RequestKV(worker.blocks, receive.BLOCK_IDS, 0, PAGES, LAYOUT)
            for page in range(PAGES):
                assert torch.equal(torch.stack([got.read_layer(page, layer) for layer in range(LAYOUT.num_layers)]),
                                   kv[:, :, page * BLOCK : (page + 1) * BLOCK]), "a rank holds another's shard"
        receive.assert_no_lease_left(server.address)
    finally:
        close(conns, workers)


def test_a_declined_handoff_is_let_go_in_every_ranks_namespace(server: ServerProcess) -> None:
    """A one-block prompt's decode must compute its last token, so it is offered nothing of the page
    handed off and declines the handoff: every rank's marker lets go of its page at once, not at the
    ttl. Before, the scheduler side declined in its own namespace (rank 0's) only: rank 1's page
    stayed pinned until the handoff's ttl."""
    prompt = list(range(1, BLOCK + 1))
    handoff_id = new_handoff_id()
    for rank in range(TP):
        receive.handed_off(server.address, prompt, kv_of(BLOCK), rank_namespace(rank), handoff_id)
    assert receive.num_leases(server.address) == TP, "each rank's marker pins its page"
    conns, handoffs, workers = decode_sides(server.address)
    try:
        assert handoffs.matched(decode_request(prompt, handoff_id), 0) == (0, False), "offered nothing"
        meta = handoffs.add_to(KVStoreConnectorMetadata())  # the step's metadata, to every rank
        for worker in workers:
            worker.begin_step(meta)
        receive.assert_no_lease_left(server.address, within_s=5.0)
    finally:
        close(conns, workers)
