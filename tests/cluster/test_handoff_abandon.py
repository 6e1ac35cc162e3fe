"""A handoff that hands off nothing (DESIGN §12.7): Complete with no pages (the prefill was
aborted, or nothing of it is of use to a decode) lets the decode node go of what was pushed to
it at once, not at the handoff's ttl, and a decode waiting on it answers nothing at once (it
recomputes) instead of sleeping to its deadline. (A wait that comes later is a wait on an unknown
id: it answers what the pool holds of its pages, as any.) Real nodes over a real etcd."""

from __future__ import annotations

import asyncio
import time

import torch
from support.cluster_nodes import cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_nodes import LAYOUT, NS, tokens_of
from test_handoff import _holds, _no_leases, num_leases

from kvstore._proto import directory_pb2
from kvstore.client import KVStoreClient, new_handoff_id
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.metadata import HandoffOpen, KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.pd_worker import HandoffWorker

TTL_S = 60.0  # far longer than any wait below: what is let go is let go by the abandon, not the ttl


async def test_a_complete_with_no_pages_lets_the_decode_node_go_of_the_pushed_pages_at_once(cluster_nodes, etcd) -> None:
    a, c = cluster_nodes(["a", "c"], "tcp")
    tokens = tokens_of(61, 4)
    kv = random_kv(LAYOUT, len(tokens), seed=61)
    async with KVStoreClient(a.address, NS) as prefill, KVStoreClient(c.address, NS) as decode:
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, "c", ttl_s=TTL_S, tokens=tokens)
        assert await prefill.put(tokens, kv) == len(tokens)
        await eventually(lambda: _holds(etcd.url, "c", 4), 10, "the pages pushed to c")
        assert await num_leases(decode) >= 1, "the marker pins what was pushed"
        assert await prefill.handoff_complete(handoff, [], "c") == 0
        await eventually(lambda: _no_leases(decode), 2.0, "the abandoned handoff's pins released")
        assert await num_leases(prefill) == 0


async def test_a_decode_waiting_on_a_handoff_that_is_abandoned_answers_nothing_at_once(cluster_nodes) -> None:
    a, c = cluster_nodes(["a", "c"], "tcp")
    tokens = tokens_of(62, 4)
    kv = random_kv(LAYOUT, len(tokens), seed=62)
    async with KVStoreClient(a.address, NS) as prefill, KVStoreClient(c.address, NS) as decode:
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, "c", ttl_s=TTL_S, tokens=tokens)
        assert await prefill.put(tokens[: 2 * LAYOUT.page_tokens], kv[:, :, : 2 * LAYOUT.page_tokens]) > 0
        waiting = asyncio.ensure_future(decode.handoff_wait(handoff, tokens, deadline_s=20.0))
        await asyncio.sleep(0.3)  # the wait sleeps on the marker: half the pages are there
        started = time.monotonic()
        assert await prefill.handoff_complete(handoff, [], "c") == 0
        hit = await asyncio.wait_for(waiting, 5.0)
        assert hit.num_tokens == 0 and time.monotonic() - started < 2.0
        await eventually(lambda: _no_leases(decode), 2.0, "the abandoned handoff's pins released")


async def test_an_aborted_prefills_worker_lets_the_decode_node_go_of_its_pages(cluster_nodes, etcd) -> None:
    """The vLLM connector's prefill worker (pd_worker.py): a handed-off request that vLLM finished
    without a completion (aborted: its client went away) completes its handoff with no page."""
    a, c = cluster_nodes(["a", "c"], "tcp")
    tokens = tokens_of(63, 4)
    kv = random_kv(LAYOUT, len(tokens), seed=63)
    store = StoreConnection(a.address, NS)
    assert store.start()
    worker = HandoffWorker(store, LAYOUT.page_tokens, 5.0, 10.0, push_layers=False)
    try:
        async with KVStoreClient(a.address, NS) as prefill, KVStoreClient(c.address, NS) as decode:
            handoff = new_handoff_id()
            worker.begin_step(KVStoreConnectorMetadata(handoff_opens=[HandoffOpen("r", handoff, "c", TTL_S, tokens)]))
            await eventually(lambda: _opened(worker), 10, "the open answered")
            assert await prefill.put(tokens, kv) == len(tokens)
            await eventually(lambda: _holds(etcd.url, "c", 4), 10, "the pages pushed to c")
            assert await num_leases(decode) >= 1
            assert worker.finished(set(), {"r"}) == (set(), set()), "an aborted request is not reported finished sending"
            await eventually(lambda: _no_leases(decode), 3.0, "the aborted prefill's pushed pages released")
    finally:
        worker.shutdown()
        store.close()


async def _opened(worker: HandoffWorker) -> bool:
    worker.finished(set(), set())  # settles the opens that answered
    return worker.stats.opened == 1


async def test_a_complete_whose_pages_are_gone_here_is_no_abandon(cluster_nodes, etcd) -> None:
    """A Complete that names pages none of which the prefill node holds now (evicted, removed):
    not an abandon. The decode node keeps what was pushed and completes the handoff with it: a decode
    waiting on it gets those pages at once (before, at its deadline; DESIGN §12.7, Failures)."""
    a, c = cluster_nodes(["a", "c"], "tcp")
    tokens = tokens_of(64, 4)
    kv = random_kv(LAYOUT, len(tokens), seed=64)
    async with KVStoreClient(a.address, NS) as prefill, KVStoreClient(c.address, NS) as decode:
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, "c", ttl_s=TTL_S, tokens=tokens)
        assert await prefill.put(tokens, kv) == len(tokens)
        await eventually(lambda: _holds(etcd.url, "c", 4), 10, "the pages pushed to c")
        keys = prefill.keys(tokens)
        await prefill._call(prefill.runtime.directory.Remove,
                            directory_pb2.RemoveRequest(namespace_id=prefill.namespace.namespace_id, keys=keys, tier="host"))
        assert await prefill.handoff_complete(handoff, tokens, "c") == len(tokens)  # what c holds
        assert await num_leases(decode) >= 1, "the pushed pages' pins were let go: eviction could take them"
        started = time.monotonic()
        hit = await decode.handoff_wait(handoff, tokens + tokens_of(65, 1), deadline_s=6.0)  # one page more than handed
        assert hit.num_tokens == len(tokens), "the pushed pages were let go"
        assert time.monotonic() - started < 2.0, "the decode waited out its deadline for a handoff that was over"
        out = torch.zeros_like(kv)
        assert await decode.get(hit, out) == len(tokens) and torch.equal(out, kv)
