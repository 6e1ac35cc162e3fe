"""The prefill node's layer-wise pushes (DESIGN §12.7): while a layer-wise save's allocation is
not committed yet, the leading layers its writer says it stored go to the decode node of each
direct handoff open here that names those pages, so that a one-step prefill's bytes move while
its later layers compute. The Push that names the pages once stored carries their checksums,
and the decode node commits the slots the layers filled; what did not arrive goes as before.

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
from kvstore.errors import KVStoreError
from kvstore.server.cluster.peers import Peers, current_cancelled
from kvstore.server.layer_landings import WrittenSlots
from kvstore.server.placement import Placement
from kvstore.server.services.sizes import LAYER_PUSH_BYTES

if TYPE_CHECKING:
    from kvstore.server.cluster.handoff_push import OpenKey, Outgoing

logger = logging.getLogger(__name__)



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
        """Sends the layers said and not sent, a few pages per call, until none is left, the
        allocation is gone (committed: the Push takes over) or the decode node refuses."""
        layout = sending.slots.layout
        layer_bytes = layout.page_bytes // layout.num_layers
        while sending.sent < sending.said:
            start, end = sending.sent, sending.said
            offset, length = start * layer_bytes, (end - start) * layer_bytes
            per_call = max(1, LAYER_PUSH_BYTES // length)
            for i in range(0, len(sending.keys), per_call):
                keys = sending.keys[i : i + per_call]
                data = await asyncio.to_thread(self._read, sending.allocation_id, keys, offset, length)
                if data is None:  # committed (the Push takes over) or given up: nothing more of it
                    self._ended(sending)
                    return
                if not await self._call(sending, keys, offset, length, data):
                    self._ended(sending)
                    return
            sending.sent = end

    def _ended(self, sending: _Sending) -> None:
        out = sending.out
        key = (sending.allocation_id, (out.tenant, out.namespace_id, out.handoff_id))
        if self._sending.get(key) is sending:
            del self._sending[key]

    def _read(self, allocation_id: bytes, keys: list[bytes], offset: int, length: int) -> bytes | None:
        """The byte range of each page, in order, in one copy; None once the allocation is gone
        (checked again after the copy: a slot given back meanwhile may hold another page's bytes)."""
        views: list[memoryview] = []
        try:
            for key in keys:
                views.append(self.core.slot_view(allocation_id, key))
            data = b"".join(view[offset : offset + length] for view in views)
        except KVStoreError:
            return None
        finally:
            for view in views:
                view.release()
        return data if self.core.leases.allocation(allocation_id) is not None else None

    async def _call(self, sending: _Sending, keys: list[bytes], offset: int, length: int, data: bytes) -> bool:
        out = sending.out
        peer = self.peers.get(out.to_node)
        if peer is None:
            return False
        request = handoff_pb2.PushLayersRequest(namespace_id=out.namespace_id, handoff_id=out.handoff_id, holder=self.node,
                                                tenant=out.tenant, layout=validate.layout_msg(sending.slots.layout), keys=keys,
                                                offset=offset, length=length, data=data, ttl_ms=out.ttl_ms)
        try:
            answer = await handoff_pb2_grpc.HandoffStub(peer.channel).PushLayers(request, timeout=self.rpc_timeout_s)
        except asyncio.CancelledError:
            if current_cancelled():
                raise
            return False
        except Exception as exc:  # noqa: BLE001 - a layer push lost costs only time: the Push sends the pages
            logger.info("handoff %s: layers not pushed to %s: %r", out.handoff_id.hex()[:8], out.to_node, exc)
            return False
        self.core.metrics.handoff_layer_bytes.labels("sent").inc(len(data))
        return int(answer.num_pages) == len(keys)


async def fetch_rest(peers: Peers, holder: str, namespace_id: bytes, keys: list[bytes], views: list[memoryview], offset: int,
                     timeout_s: float, generation: int) -> list[int]:
    """At the decode node: each page's bytes from ``offset`` on, from ``holder`` over the data plane,
    unhashed, of this node's ``generation`` (a holder of another serves none); the stored checksums
    of the leading pages that arrived."""
    peer = peers.get(holder)
    if peer is None or peer.fetcher is None:
        return []
    result = await peer.fetcher.fetch(namespace_id, keys, views, timeout_s, generation, hashed=False, offset=offset)
    return result.checksums[: result.prefix]
