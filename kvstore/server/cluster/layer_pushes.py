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
from kvstore.page import LayoutDesc
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
                if not keys or not out.may_push():
                    continue
                sending = self._sending[key] = _Sending(out, allocation_id, slots, keys)
            sending.said = max(sending.said, min(layers, slots.layout.num_layers))
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

    async def finish(self, out: Outgoing, keys: list[bytes]) -> list[int]:
        """Before the Push of ``keys`` (stored here now) to a handoff whose layers went ahead: the
        layers not sent yet of those pages go now, from the stored pages, so that the decode node
        commits every page in place; returns the stored checksums of the leading ``keys``."""
        handoff = (out.tenant, out.namespace_id, out.handoff_id)
        sendings = [s for (_, k), s in self._sending.items() if k == handoff]
        running = {s.task for s in sendings if s.task is not None and not s.task.done()}
        if running:  # they end at their next read: the allocation is committed
            await asyncio.wait(running, timeout=self.rpc_timeout_s)
        wanted = set(keys)
        rest: dict[int, list[bytes]] = {}  # layers sent -> the pages whose later layers are missing there
        for s in sendings:
            if 0 < s.sent < s.slots.layout.num_layers:
                rest.setdefault(s.sent, []).extend(k for k in s.keys if k in wanted)
        layout = sendings[0].slots.layout if sendings else None
        sums, ranges = await asyncio.to_thread(self._read_stored, out.namespace_id, keys, rest, layout)
        for sent, data in ranges.items():
            assert layout is not None
            layer_bytes = layout.page_bytes // layout.num_layers
            length = layout.page_bytes - sent * layer_bytes
            pages = rest[sent][: len(data) // length]
            per_call = max(1, LAYER_PUSH_BYTES // length)
            for i in range(0, len(pages), per_call):
                chunk = data[i * length : (i + per_call) * length]
                sending = _Sending(out, b"", WrittenSlots(out.namespace_id, layout, pages), pages)
                if not await self._call(sending, pages[i : i + per_call], sent * layer_bytes, length, chunk):
                    break
        return sums

    def _read_stored(self, namespace_id: bytes, keys: list[bytes], rest: dict[int, list[bytes]],
                     layout: LayoutDesc | None) -> tuple[list[int], dict[int, bytes]]:
        """The stored checksums of the leading ``keys`` held here, and per group of ``rest`` the
        pages' bytes from that many layers on (those held); a worker thread's call."""
        try:
            lease_id, pages = self.core.acquire(namespace_id, keys, 1_000, False)
        except KVStoreError:
            return [], {}
        try:
            held = {page.header.key: page for page in pages}
            ranges: dict[int, bytes] = {}
            for sent, group in rest.items():
                assert layout is not None
                start = sent * (layout.page_bytes // layout.num_layers)
                parts = []
                for key in group:
                    if (page := held.get(key)) is None:
                        break
                    view = self.core.read_view(page)
                    parts.append(bytes(view[start:]))
                    view.release()
                ranges[sent] = b"".join(parts)
            return [page.checksum for page in pages], ranges
        finally:
            self.core.release(lease_id)

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
                if data is None or not await self._call(sending, keys, offset, length, data):
                    return
            sending.sent = end

    def _read(self, allocation_id: bytes, keys: list[bytes], offset: int, length: int) -> bytes | None:
        """The byte range of each page, in order; None once the allocation is gone."""
        out = bytearray(len(keys) * length)
        for i, key in enumerate(keys):
            try:
                view = self.core.slot_view(allocation_id, key)
            except KVStoreError:
                return None
            try:
                out[i * length : (i + 1) * length] = view[offset : offset + length]
            finally:
                view.release()
        return bytes(out)

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
        out.layered = True
        return int(answer.num_pages) == len(keys)
