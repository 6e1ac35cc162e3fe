"""An adversarial review of the layer-wise handoff pushes (DESIGN §12.7): each test failed on
their first version (a retried save's pages committed mixed, a layout other than the slots' an
internal error, slots committed without the holder storing the pages in this generation, the
prefill node's per-allocation state kept for ended allocations)."""

from __future__ import annotations

import dataclasses
import os

import torch
from support.cluster_nodes import cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture, free_port  # noqa: F401  # the fixture
from support.kv import random_kv
from support.metrics import metric
from test_cluster_nodes import LAYOUT, NS, tokens_of
from test_handoff_layers import LAYER_BYTES, _landed, prefill_and_decode

from kvstore import validate
from kvstore._proto import handoff_pb2
from kvstore.client import KVStoreClient, new_handoff_id
from kvstore.client.pages import slot_as_page
from kvstore.client.transport import ShmTransport
from kvstore.client.transport.contract import page_in
from kvstore.errors import InvalidRequest, PageCorrupt
from kvstore.page import LayoutDesc

DESC = LayoutDesc.of(LAYOUT)


async def test_a_save_retried_after_an_abandoned_one_is_handed_off_intact(cluster_nodes) -> None:
    """A layer-wise save says layer 0 (pushed to c), then is abandoned (its allocation aborted at a;
    an engine preempted, say). The request is computed again and stored (its bytes need not be
    bit-identical: another batch shape) and the handoff completed. The decode side's read must
    get the pages: a's pushes must not commit at c a page made of the abandoned save's layer 0
    and the stored page's other layers (which fails its check: PageCorrupt, a recompute)."""
    a, c, port = prefill_and_decode(cluster_nodes)
    tokens = tokens_of(71, 3)
    old = random_kv(LAYOUT, len(tokens), seed=70)  # the abandoned attempt's bytes
    kv = random_kv(LAYOUT, len(tokens), seed=71)
    async with KVStoreClient(a.address, NS) as prefill, KVStoreClient(c.address, NS) as decode:
        prefill.push_layers_min_bytes = 0  # a few small pages: their layers go ahead all the same
        keys = prefill.keys(tokens)
        assert isinstance(prefill.transport, ShmTransport)
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, "c", tokens=tokens)
        out = prefill.transport.outgoing()
        await prefill._io(out.reserve(keys))
        for i, buffer in zip(out.indices, out.buffers):
            page_in(slot_as_page(buffer, LAYOUT), old, i, LAYOUT)
        await prefill._io(out.written(1, 5.0))
        await eventually(lambda: _landed(port, 3 * LAYER_BYTES), 10, "the abandoned save's layer 0 landed at c")
        await prefill._io(out.discard())  # abandoned: its allocation aborted, nothing stored at a
        assert await prefill.put(tokens, kv) == len(tokens)  # computed again and stored
        assert await prefill.handoff_complete(handoff, tokens, "c") == len(tokens)
        hit = await decode.handoff_wait(handoff, tokens, deadline_s=5.0)
        assert hit.num_tokens == len(tokens)
        got = torch.zeros_like(kv)
        try:
            n = await decode.get(hit, got)
        except PageCorrupt as exc:
            n = exc.num_tokens  # type: ignore[attr-defined]
        assert torch.equal(got[:, :, :n], kv[:, :, :n]), "wrong bytes served"
        assert n == len(tokens), (f"{n} of {len(tokens)} tokens read; "
                                  f"{metric(port, 'kvstore_handoff_layer_pages_total')} pages committed in place at c")


async def test_push_layers_in_a_layout_other_than_the_slots_is_a_clear_answer(cluster_nodes) -> None:
    """A PushLayers whose layout is not the namespace's (a node on another build, a bad peer)
    after slots were made in the namespace's layout must be refused (InvalidRequest) or land
    nothing; it must not fail inside the write with an internal error."""
    a, c = cluster_nodes(["a", "c"], "tcp")
    bigger = dataclasses.replace(DESC, num_layers=DESC.num_layers + 1)
    tokens = tokens_of(72, 1)
    async with KVStoreClient(a.address, NS) as prefill, KVStoreClient(c.address, NS) as node:  # no tenants: node right
        keys = node.keys(tokens)
        handoff = os.urandom(16)
        assert isinstance(prefill.transport, ShmTransport)
        out = prefill.transport.outgoing()
        await prefill._io(out.reserve(keys))  # a's allocation the ranges are fetched from

        def request(desc: LayoutDesc, offset: int, length: int) -> handoff_pb2.PushLayersRequest:
            return handoff_pb2.PushLayersRequest(namespace_id=NS.namespace_id, handoff_id=handoff, holder="a", tenant="",
                                                 layout=validate.layout_msg(desc), keys=keys, offset=offset, length=length,
                                                 allocation=out._alloc.allocation_id, ttl_ms=5_000)

        first = await node._call(node.runtime.handoff.PushLayers, request(DESC, 0, LAYER_BYTES))
        assert first.num_pages == 1  # layer 0 landed in the namespace's layout
        try:
            answer = await node._call(node.runtime.handoff.PushLayers, request(bigger, LAYER_BYTES, DESC.page_bytes))
        except InvalidRequest:
            answer = None
        assert answer is None or answer.num_pages == 0
        await prefill._io(out.discard())


async def test_layers_land_and_commit_only_for_pages_the_holder_stores(cluster_nodes) -> None:
    """A Push with checksums commits at c slots whose bytes came ahead, without asking the holder
    for anything. The normal path (copy_from) reads from the holder for c's generation, so that a
    holder behind an invalidation gives nothing; here a holder that stores nothing of the pages
    (at c's generation) still gets them committed at c: stale bytes after an invalidation whose
    news has not reached the prefill node yet, served as current at c."""
    _, c = cluster_nodes(["a", "c"], "tcp")  # a: the holder the Push names
    tokens = tokens_of(73, 2)
    async with KVStoreClient(c.address, NS) as node:  # a runs, and stores nothing of these pages
        keys = node.keys(tokens)
        handoff = os.urandom(16)
        ahead = DESC.page_bytes - LAYER_BYTES  # every layer but the last, of an allocation a does not have
        layers = handoff_pb2.PushLayersRequest(namespace_id=NS.namespace_id, handoff_id=handoff, holder="a", tenant="",
                                               layout=validate.layout_msg(DESC), keys=keys, offset=0,
                                               length=ahead, allocation=os.urandom(16), ttl_ms=5_000)
        assert (await node._call(node.runtime.handoff.PushLayers, layers)).num_pages == 0  # a serves nothing of it
        push = handoff_pb2.PushHandoffRequest(namespace_id=NS.namespace_id, handoff_id=handoff, keys=keys, holder="a",
                                              tenant="", page_bytes=DESC.page_bytes, complete=True, ttl_ms=5_000)
        held = (await node._call(node.runtime.handoff.Push, push)).num_pages
        assert held == 0, "c committed pages its holder a does not store (in any generation c would read from it)"


async def test_the_sends_of_ended_allocations_are_not_kept() -> None:
    """A client that saves (and abandons, or commits) the same handoff's pages again and again
    within one open handoff leaves one ``_Sending`` (its keys list, a task) per allocation at the
    prefill node until Complete or the ttl; an allocation that ended with nothing landed is kept
    for nothing (and one that landed layers is what finish() wrongly mixes in, above)."""
    import asyncio
    import time

    from kvstore.errors import LeaseExpired
    from kvstore.server.cluster.handoff_push import Outgoing
    from kvstore.server.cluster.layer_pushes import LayerPushes
    from kvstore.server.layer_landings import WrittenSlots

    class GoneLeases:
        def allocation(self, allocation_id: bytes) -> None:
            return None

    class GoneCore:  # every allocation has ended by the time its layers are said
        leases = GoneLeases()

        def slot_view(self, allocation_id: bytes, key: bytes) -> memoryview:
            raise LeaseExpired("gone")

    class Peer:  # on a data plane that fetches ranges
        fetcher = object()
        channel = None

    class NoPeers:
        def get(self, node: str) -> Peer:
            return Peer()

    keys = [bytes([i]) * 16 for i in range(4)]
    out = Outgoing("t", b"n" * 16, b"h" * 16, "c", 30_000, time.monotonic() + 30, keys, lambda: True)
    pushes = LayerPushes("a", GoneCore(), NoPeers(), 1.0, lambda tenant, ns: [out])  # type: ignore[arg-type]
    for n in range(200):
        pushes.written("t", n.to_bytes(16, "big"), WrittenSlots(out.namespace_id, DESC, keys), 1)
    await asyncio.sleep(0.5)
    assert len(pushes._sending) <= 1, f"{len(pushes._sending)} sends kept for allocations that ended"
    await pushes.close()
