"""The prefill node's layer-wise pushes (DESIGN §12.7): while a layer-wise save's allocation is
not committed yet, the leading layers its writer says it stored are said to the decode node of
each direct handoff open here that names those pages, which fetches them from here over the data
plane (``fetch_range``), so that a one-step prefill's bytes move while its later layers compute.
At the Push of the pages once stored, the decode node fetches each page's rest and commits what
matches the stored checksum (server/layer_landings.py); what did not arrive goes as before.

More: kvstore/server/cluster/README.md (### layer_pushes.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore import validate
from kvstore._proto import handoff_pb2, handoff_pb2_grpc
from kvstore.cluster.page_fetch import FetchResult
from kvstore.page_wire.fetch_frames import MAX_KEYS, NO_ALLOCATION
from kvstore.server.cluster.peers import Peers, current_cancelled
from kvstore.server.layer_landings import WrittenSlots
from kvstore.server.placement import Placement

if TYPE_CHECKING:
    from kvstore.server.cluster.handoff_push import OpenKey, Outgoing

logger = logging.getLogger(__name__)

PULL_BYTES = 32 << 20  # of the ranges one PushLayers names (the decode node fetches them in one request)



@dataclass
class _Sending:
    """One allocation's layers on their way to one handoff's decode node."""

    out: Outgoing
    allocation_id: bytes
    slots: WrittenSlots
    keys: list[bytes]  # of the allocation's, those the handoff names
    said: int = 0  # leading layers the writer said it stored
    sent: int = 0  # leading layers the decode node took
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class LayerPushes:
    """Kept by ``HandoffPushes``; its methods run on the cluster loop."""

    def __init__(self, node: str, core: Placement, peers: Peers, rpc_timeout_s: float,
                 open_for: Callable[[str, bytes], list[Outgoing]]) -> None:
        self.node = node
        self.core = core
        self.peers = peers
        self.rpc_timeout_s = rpc_timeout_s
        self.open_for = open_for  # (tenant, namespace) -> the direct handoffs open here
        self._sending: dict[tuple[bytes, OpenKey], _Sending] = {}

    def written(self, tenant: str, allocation_id: bytes, slots: WrittenSlots, layers: int) -> None:
        """The writer of ``allocation_id`` stored its leading ``layers`` in every slot."""
        for out in self.open_for(tenant, slots.namespace_id):
            key = (allocation_id, (out.tenant, out.namespace_id, out.handoff_id))
            sending = self._sending.get(key)
            if sending is None:
                named = set(out.keys[out.queued :])  # pages already stored here go by the Push
                keys = [k for k in slots.keys if k in named]
                peer = self.peers.get(out.to_node)
                if not keys or peer is None or peer.fetcher is None or not out.may_push():
                    continue  # on the gRPC data plane the decode node cannot fetch a page's rest: the pages go whole
                sending = self._sending[key] = _Sending(out, allocation_id, slots, keys)
            # never the last layer: the decode node fetches each page's rest once stored (checked against its generation)
            sending.said = max(sending.said, min(layers, slots.layout.num_layers - 1))
            if sending.task is None or sending.task.done():
                sending.task = asyncio.create_task(self._send(sending), name=f"layers-{out.handoff_id.hex()[:8]}")

    def forget(self, key: OpenKey) -> None:
        """The handoff ended here: its sends stop (cancelled; a read in flight ends on its thread)."""
        for ended in [k for k in self._sending if k[1] == key]:
            task = self._sending.pop(ended).task
            if task is not None:
                task.cancel()

    async def close(self) -> None:
        tasks = [s.task for s in self._sending.values() if s.task is not None]
        self._sending.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def whole(self, out: Outgoing, start: int, end: int) -> int:
        """``end``, or less, so that a Push of ``out.keys[start:end]`` names all or none of the pages of
        each allocation whose layers went ahead and that is not committed yet. Why: the decode node ends
        a landing's allocation at the first Push that names any of its pages, its other pages' layers
        given back (a second writer of the same prefix stores the first pages of it early)."""
        handoff = (out.tenant, out.namespace_id, out.handoff_id)
        live = [s for (allocation_id, k), s in self._sending.items()
                if k == handoff and self.core.leases.allocation(allocation_id) is not None]
        if not live:
            return end  # no layers on their way (the usual case): no index of the handoff's keys made
        where = {key: i for i, key in enumerate(out.keys[start:], start)}
        spans = [(min(found), max(found)) for s in live if (found := [where[key] for key in s.keys if key in where])]
        while any(first < end <= last for first, last in spans):
            end = min(first for first, last in spans if first < end <= last)
        return end

    async def settle(self, out: Outgoing) -> None:
        """Before the Push of pages stored here: this handoff's layer sends in flight end first (each
        ends at its next read, its allocation committed), so that the decode node holds what they carry."""
        handoff = (out.tenant, out.namespace_id, out.handoff_id)
        running = {s.task for (_, k), s in self._sending.items() if k == handoff and s.task is not None and not s.task.done()}
        if running:
            await asyncio.wait(running, timeout=self.rpc_timeout_s)
        for key in [k for k, s in self._sending.items() if k[1] == handoff and self.core.leases.allocation(k[0]) is None]:
            del self._sending[key]  # its allocation committed or went: nothing more of it is sent

    async def _send(self, sending: _Sending) -> None:
        """Says the layers written and not said yet, a batch of pages per call (the decode node
        fetches each batch's range from here before it answers), until none is left, the
        allocation is gone (committed: the Push takes over) or the decode node refuses."""
        layout = sending.slots.layout
        layer_bytes = layout.page_bytes // layout.num_layers
        while sending.sent < sending.said:
            start, end = sending.sent, sending.said
            offset, length = start * layer_bytes, (end - start) * layer_bytes
            per_call = max(1, min(MAX_KEYS, PULL_BYTES // length))
            for i in range(0, len(sending.keys), per_call):
                if self.core.leases.allocation(sending.allocation_id) is None or \
                        not await self._call(sending, sending.keys[i : i + per_call], offset, length):
                    self._ended(sending)  # committed (the Push takes over), given up, or refused
                    return
            sending.sent = end

    def _ended(self, sending: _Sending) -> None:
        out = sending.out
        key = (sending.allocation_id, (out.tenant, out.namespace_id, out.handoff_id))
        if self._sending.get(key) is sending:
            del self._sending[key]

    async def _call(self, sending: _Sending, keys: list[bytes], offset: int, length: int) -> bool:
        out = sending.out
        peer = self.peers.get(out.to_node)
        if peer is None:
            return False
        request = handoff_pb2.PushLayersRequest(namespace_id=out.namespace_id, handoff_id=out.handoff_id, holder=self.node,
                                                tenant=out.tenant, layout=validate.layout_msg(sending.slots.layout), keys=keys,
                                                offset=offset, length=length, allocation=sending.allocation_id,
                                                ttl_ms=out.ttl_ms)
        try:
            answer = await handoff_pb2_grpc.HandoffStub(peer.channel).PushLayers(request, timeout=self.rpc_timeout_s)
        except asyncio.CancelledError:
            if current_cancelled():
                raise
            return False
        except Exception as exc:  # noqa: BLE001 - a layer push lost costs only time: the page comes whole
            logger.info("handoff %s: layers not pushed to %s: %r", out.handoff_id.hex()[:8], out.to_node, exc)
            return False
        landed = int(answer.num_pages)
        self.core.metrics.handoff_layer_bytes.labels("sent").inc(landed * length)
        return landed == len(keys)


async def fetch_range(peers: Peers, holder: str, namespace_id: bytes, keys: list[bytes], views: list[memoryview],
                      offset: int, page_bytes: int, timeout_s: float, generation: int,
                      allocation: bytes = NO_ALLOCATION) -> FetchResult | None:
    """At the decode node: a range of each page from ``holder`` over the data plane, unhashed, of
    this node's ``generation`` (a holder in another serves none): of its stored pages (the rest of
    pages whose layers came ahead: the answer carries their stored checksums) or, with
    ``allocation``, of pages it has not committed yet (their layers as the prefill computes them).
    None on the gRPC data plane (no range fetch there)."""
    peer = peers.get(holder)
    if peer is None or peer.fetcher is None:
        return None
    return await peer.fetcher.fetch(namespace_id, keys, views, timeout_s, generation, hashed=False, offset=offset,
                                    page_bytes=page_bytes, allocation=allocation)
