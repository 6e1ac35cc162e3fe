"""The hybrid connector's worker side times its steps and loads for the cost model (DESIGN
§10), as the single-group one does, and a load is bounded by its deadline: a real
kvstore-server, one connection straight to it and one through an emulated slow link
(bench/common/linkproxy.py); vLLM's CPU block layout, two KV cache groups."""

from __future__ import annotations

import random

import pytest
import torch
from support.servers import ServerProcess

from kvstore import KVLayout, Namespace
from kvstore.bench.common.linkproxy import LinkProxy
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.hybrid_worker import HybridWorkerSide
from kvstore.client.adapters.vllm.metadata import GroupLoad, GroupSave, KVStoreConnectorMetadata

BLOCK, HEADS, DIM, NUM_BLOCKS = 32, 2, 32, 16
NAMES, GROUPS = ["l0", "l1"], [0, 1]  # a window group and a full-attention group
LAYOUT = KVLayout(num_layers=2, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, page_tokens=BLOCK,
                  groups=("sliding_window=48:l0", "full:l1"))
PAGES = 4


@pytest.fixture
def store(server_process: ServerProcess) -> ServerProcess:
    server_process.start()
    return server_process


def worker(address: str, **conn: bool) -> tuple[StoreConnection, HybridWorkerSide, dict[str, torch.Tensor]]:
    store = StoreConnection(address, Namespace(model="hybrid-costs", revision="r", layout=LAYOUT), **conn)
    assert store.start()
    caches = {name: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM) for name in NAMES}  # vLLM's CPU layout
    side = HybridWorkerSide(store, NAMES, GROUPS, BLOCK)
    side.register(caches)
    return store, side, caches


def step(side: HybridWorkerSide, meta: KVStoreConnectorMetadata) -> None:
    """One step in vLLM's order for an engine with asynchronous loads."""
    side.begin_step(meta)
    side.start_loads(meta)  # after the forward pass
    side.end_step()


def test_steps_and_loads_are_timed_and_a_load_ends_at_its_deadline(store: ServerProcess) -> None:
    """Bug: the hybrid worker timed nothing (its scheduler side decided on the priors for
    ever) and a load waited a timeout of the prior's (at least 1 s), not the deadline the
    scheduler side gives it. A step without loads reports its prefill tokens and seconds;
    a load over the store's own link lands whole and reports its bytes; the same load over a
    20 kB/s link (1.6 s a page) is cut at its 0.3 s deadline, reported failed, and measured
    at the pace of the pages it received (none: four times its stall), and the connection is
    kept (a deadline is no failure of it)."""
    tokens = [random.Random(3).randrange(1, 50_000) for _ in range(PAGES * BLOCK + 5)]
    direct, writer, caches = worker(store.address)
    proxy = LinkProxy(store.address, 20e3)
    slow_conn, slow, _ = worker(proxy.address, use_shm=False, use_call_socket=False)
    try:
        for i, name in enumerate(NAMES):
            caches[name].copy_(torch.randn_like(caches[name]) + i)
        step(writer, KVStoreConnectorMetadata(group_saves=[GroupSave("w", tokens[: PAGES * BLOCK], ([1, 2, 3, 4], [5, 6, 7, 8]), 0)],
                                              num_scheduled_tokens=len(tokens), num_prefill_tokens=len(tokens)))
        assert writer.wait_saves(10) and writer.stats.saved_tokens == PAGES * BLOCK
        report = writer.report()
        assert report is not None and [n for n, _ in report.step_costs] == [len(tokens)] and not report.load_costs

        _, reader, into = worker(store.address)
        # the window group's first block dropped (vLLM's null block 0): not written
        load = GroupLoad("r", tokens[: PAGES * BLOCK], ([0, 10, 11, 12], [13, 14, 15, 9]), 0, PAGES, deadline_s=10.0)
        step(reader, KVStoreConnectorMetadata(group_loads=[load], num_scheduled_tokens=7, num_prefill_tokens=7))
        assert reader.transfer_results() == ({"r"}, set())
        assert torch.equal(into["l0"][10:13], caches["l0"][2:5]) and not into["l0"][0].any()
        assert torch.equal(into["l1"][[13, 14, 15, 9]], caches["l1"][5:9])
        report = reader.report()
        assert report is not None and [n for n, _ in report.load_costs] == [PAGES * LAYOUT.page_bytes]
        assert not report.step_costs, "a step that loads is no recompute observation"
        reader.store.close()

        client = slow_conn.client()
        step(slow, KVStoreConnectorMetadata(group_loads=[GroupLoad("s", load.tokens, load.block_ids, 0, PAGES, deadline_s=0.3)]))
        assert slow.transfer_results() == ({"s"}, {"s"}) and slow.stats.failed_loads == 1
        report = slow.report()
        assert report is not None
        [(num_bytes, seconds)] = report.load_costs
        assert num_bytes == PAGES * LAYOUT.page_bytes and seconds >= PAGES * 0.3
        assert slow_conn.client() is client, "a load cut at its deadline dropped the connection"
    finally:
        slow_conn.close()
        direct.close()
        proxy.close()
