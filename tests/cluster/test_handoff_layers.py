"""Layer-wise handoff pushes (DESIGN §12.7) on real nodes over a real etcd: the layers a
layer-wise save stored go to the decode node before the pages are committed at the prefill
node, and at the Push that names the pages once stored the decode node fetches the rest of each
and commits them in place; a save given
up midway leaves nothing at the decode node once the handoff's ttl passes; layers that landed
wrong are never committed (the decode node checks each assembled page against the holder's checksum)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch
from support.cluster_nodes import Node, cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture, free_port  # noqa: F401  # the fixture
from support.kv import random_kv
from support.metrics import metric
from test_cluster_nodes import LAYOUT, NS, tokens_of
from test_handoff import num_leases

from kvstore.client import KVStoreClient, new_handoff_id
from kvstore.client.pages import slot_as_page
from kvstore.client.transport import ShmTransport
from kvstore.client.transport.contract import page_in
from kvstore.page import checksum

PAGE = LAYOUT.page_tokens
LAYER_BYTES = LAYOUT.page_bytes // LAYOUT.num_layers


def prefill_and_decode(cluster_nodes: Callable[..., list[Node]]) -> tuple[Node, Node, int]:
    """Nodes a (prefill) and c (decode, its /metrics on the port returned) on the TCP data plane."""
    port = free_port()
    a, c = cluster_nodes(["a", "c"], "tcp", each={"c": ["--metrics-listen", f"127.0.0.1:{port}"]})
    return a, c, port


@pytest.mark.parametrize("data_plane", ["tcp", "ucx", "grpc"])
async def test_layers_go_ahead_of_the_commit_and_are_committed_in_place(cluster_nodes, data_plane: str) -> None:
    """On the gRPC data plane the decode node cannot fetch a page's rest: no layer goes ahead there,
    the pages go whole at the Push, as before."""
    port = free_port()
    a, c = cluster_nodes(["a", "c"], data_plane, each={"c": ["--metrics-listen", f"127.0.0.1:{port}"]})
    tokens = tokens_of(61, 6)
    kv = random_kv(LAYOUT, len(tokens), seed=61)
    ahead = LAYOUT.num_layers - 1
    layered = data_plane != "grpc"
    async with KVStoreClient(a.address, NS) as prefill, KVStoreClient(c.address, NS) as decode:
        prefill.push_layers_min_bytes = 0  # these saves are a few small pages: their layers go ahead all the same
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, "c", tokens=tokens)
        save = prefill.save(tokens, kv)
        for layer in range(ahead):  # the engine computed these; the last one is not done yet
            save.layer_done(layer)
        if layered:
            await eventually(lambda: _landed(port, 6 * ahead * LAYER_BYTES), 10,
                             "the first layers landed at c before the save's commit")
        assert metric(port, "kvstore_handoff_layer_pages_total") == 0  # nothing committed before the pages are stored at a
        assert await save.finished() == len(tokens)
        assert await prefill.handoff_complete(handoff, tokens, "c") == len(tokens)
        hit = await decode.handoff_wait(handoff, tokens, deadline_s=5.0)
        assert hit.num_tokens == len(tokens)
        assert metric(port, "kvstore_handoff_layer_pages_total") == (6 if layered else 0)
        out = torch.zeros_like(kv)
        assert await decode.get(hit, out) == len(tokens)
        assert torch.equal(out, kv)
        assert await num_leases(decode) == 0 and await num_leases(prefill) == 0
        if not layered:
            assert metric(port, "kvstore_handoff_layer_bytes_total") == 0


async def test_a_second_writer_of_the_first_pages_does_not_cut_the_landing(cluster_nodes) -> None:
    """Pages 0-2 of a layer-wise save whose layers went ahead are stored first by another writer of
    the same prefix: no Push names them before the save's own commit. A Push that named part of the
    landing's allocation ended it at the decode node, its other pages' layers given back (3 of 6
    were committed in place)."""
    a, c, port = prefill_and_decode(cluster_nodes)
    tokens = tokens_of(65, 6)
    kv = random_kv(LAYOUT, len(tokens), seed=65)
    ahead = LAYOUT.num_layers - 1
    async with KVStoreClient(a.address, NS) as prefill, KVStoreClient(a.address, NS) as other, \
            KVStoreClient(c.address, NS) as decode:
        prefill.push_layers_min_bytes = 0  # these saves are a few small pages: their layers go ahead all the same
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, "c", tokens=tokens)
        save = prefill.save(tokens, kv)
        for layer in range(ahead):
            save.layer_done(layer)
        await eventually(lambda: _landed(port, 6 * ahead * LAYER_BYTES), 10, "the first layers landed at c")
        assert await other.save(tokens[: 3 * PAGE], kv[:, :, : 3 * PAGE].contiguous()).finished() == 3 * PAGE
        await asyncio.sleep(0.5)  # time for a Push of the other writer's pages to start (none may); not awaited on
        assert await save.finished() == len(tokens)
        assert await prefill.handoff_complete(handoff, tokens, "c") == len(tokens)
        hit = await decode.handoff_wait(handoff, tokens, deadline_s=5.0)
        assert hit.num_tokens == len(tokens)
        assert metric(port, "kvstore_handoff_layer_pages_total") == 6
        out = torch.zeros_like(kv)
        assert await decode.get(hit, out) == len(tokens) and torch.equal(out, kv)


async def test_a_save_given_up_midway_leaves_nothing_at_the_decode_node(cluster_nodes) -> None:
    a, c, port = prefill_and_decode(cluster_nodes)
    tokens = tokens_of(62, 4)
    kv = random_kv(LAYOUT, len(tokens), seed=62)
    async with KVStoreClient(a.address, NS) as prefill, KVStoreClient(c.address, NS) as decode:
        prefill.push_layers_min_bytes = 0  # these saves are a few small pages: their layers go ahead all the same
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, "c", ttl_s=1.0, tokens=tokens)
        save = prefill.save(tokens, kv)
        save.layer_done(0)
        await eventually(lambda: _landed(port, 4 * LAYER_BYTES), 10,
                         "layer 0 landed at c")
        assert await _host_used(c.address) > 0  # the slots the layer landed in
        save.abandon("the request was cancelled")
        save.join(5)
        # the handoff's ttl passes: its marker goes at c, and the slots with it
        await eventually(lambda: _host_used_is(c.address, 0), 10, "the landing slots given back at c")
        hit = await decode.handoff_wait(handoff, tokens, deadline_s=0.3)
        assert hit.num_tokens == 0
        assert await num_leases(decode) == 0 and await num_leases(prefill) == 0
        assert metric(port, "kvstore_handoff_layer_pages_total") == 0


async def test_layers_that_landed_wrong_are_never_served(cluster_nodes) -> None:
    """Layer 0 is written wrong into the prefill's slots, said written (pushed to c), then
    written right before the commit: the prefill node stores the right page, c's slot holds the
    wrong layer. c hashes what lands and checks the assembled page against the holder's stored
    checksum before it commits: the mix is not committed, the pages come whole, and the decode
    side reads them right the first time."""
    a, c, port = prefill_and_decode(cluster_nodes)
    tokens = tokens_of(63, 3)
    kv = random_kv(LAYOUT, len(tokens), seed=63)
    async with KVStoreClient(a.address, NS) as prefill, KVStoreClient(c.address, NS) as decode:
        keys = prefill.keys(tokens)
        assert isinstance(prefill.transport, ShmTransport)
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, "c", tokens=tokens)
        out = prefill.transport.outgoing()
        await prefill._io(out.reserve(keys))
        for buffer in out.buffers:
            buffer.fill_(0x5A)  # every layer wrong
        await prefill._io(out.written(1, 5.0))
        await eventually(lambda: _landed(port, 3 * LAYER_BYTES), 10, "the wrong layer 0 landed at c")
        for i, buffer in zip(out.indices, out.buffers):
            page_in(slot_as_page(buffer, LAYOUT), kv, i, LAYOUT)
        assert await prefill._io(out.publish([checksum(b.numpy()) for b in out.buffers], False)) == 3
        await prefill._io(out.discard())
        assert await prefill.handoff_complete(handoff, tokens, "c") == len(tokens)
        hit = await decode.handoff_wait(handoff, tokens, deadline_s=5.0)
        got = torch.zeros_like(kv)
        assert await decode.get(hit, got) == len(tokens)
        assert torch.equal(got, kv)
        assert metric(port, "kvstore_handoff_layer_pages_total") == 0  # none committed from the wrong layers


async def test_a_small_save_sends_no_layer_ahead(cluster_nodes) -> None:
    """Below ``push_layers_min_bytes`` (8 MiB) a save says no layer: its layers going ahead would save
    a handoff little and cost the prefill a few hops per layer (DESIGN §12.7); the pages go whole."""
    a, c, port = prefill_and_decode(cluster_nodes)
    tokens = tokens_of(64, 4)
    kv = random_kv(LAYOUT, len(tokens), seed=64)
    async with KVStoreClient(a.address, NS) as prefill, KVStoreClient(c.address, NS) as decode:
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, "c", tokens=tokens)
        save = prefill.save(tokens, kv)
        for layer in range(LAYOUT.num_layers - 1):
            save.layer_done(layer)
        assert await save.finished() == len(tokens)
        assert await prefill.handoff_complete(handoff, tokens, "c") == len(tokens)
        hit = await decode.handoff_wait(handoff, tokens, deadline_s=5.0)
        out = torch.zeros_like(kv)
        assert await decode.get(hit, out) == len(tokens) and torch.equal(out, kv)
        assert metric(port, "kvstore_handoff_layer_bytes_total") == 0


async def _landed(port: int, at_least: int) -> bool:
    return metric(port, 'kvstore_handoff_layer_bytes_total{side="landed"}') >= at_least


async def _host_used(address: str) -> int:
    from kvstore._proto import directory_pb2

    async with KVStoreClient(address, NS) as client:
        stats = await client._call(client.runtime.directory.Stats, directory_pb2.StatsRequest())
        return next(t.used_bytes for t in stats.tiers if t.tier == "host")


async def _host_used_is(address: str, value: int) -> bool:
    return await _host_used(address) == value
