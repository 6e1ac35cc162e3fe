"""The prefill node's half of a handoff (DESIGN §12.7): pages pushed to the decode node
as they are stored here, then the full set named so that the decode node marks it complete.

More: kvstore/server/cluster/README.md (### handoff_push.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore._proto import handoff_pb2, handoff_pb2_grpc
from kvstore.errors import LimitExceeded, TierUnavailable
from kvstore.server.cluster.layer_pushes import LayerPushes
from kvstore.server.cluster.peers import Peers, current_cancelled
from kvstore.server.cluster.remote import RemoteTier
from kvstore.server.handoff_markers import MAX_HANDOFFS_PER_TENANT
from kvstore.server.layer_landings import WrittenSlots

logger = logging.getLogger(__name__)

DEFAULT_TTL_MS = 30_000
MAX_PUSHES = 2  # calls of one handoff in flight at once (each holds a unary worker of the decode node)
OpenKey = tuple[str, bytes, bytes]  # tenant (as named to other nodes), namespace id, handoff id


@dataclass
class Outgoing:
    tenant: str
    namespace_id: bytes
    handoff_id: bytes
    to_node: str
    ttl_ms: int
    expires: float  # monotonic
    keys: list[bytes]
    may_push: Callable[[], bool]  # the caller may still read the namespace here
    sent: int = 0  # leading keys the decode node holds
    queued: int = 0  # leading keys given to pushes (in flight, or answered)
    failed: bool = False  # a push came back short: the rest waits for Complete
    answered: dict[int, int] = field(default_factory=dict)  # start -> end of pushes held whole, past ``sent``
    tasks: set[asyncio.Task[None]] = field(default_factory=set, repr=False)


class HandoffPushes:
    def __init__(self, node: str, remote: RemoteTier, peers: Peers, rpc_timeout_s: float,
                 per_tenant: int = MAX_HANDOFFS_PER_TENANT) -> None:
        self.node = node
        self.remote = remote
        self.directory = remote.core.directory
        self.peers = peers
        self.rpc_timeout_s = rpc_timeout_s
        self.per_tenant = per_tenant
        self._open: dict[OpenKey, Outgoing] = {}
        self._by_namespace: dict[bytes, set[OpenKey]] = {}
        self._loop = asyncio.get_running_loop()
        self._pending: set[bytes] = set()  # namespaces stored in, handed to the loop and not yet kicked
        self._closed = False
        self._sweeper: asyncio.Task[None] | None = None
        self.num_pushed = 0
        self.layers = LayerPushes(node, remote.core, peers, rpc_timeout_s, self._direct)
        self.directory.events.listen(self._on_stored)  # now, not at start(): an open served before it is kicked too

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._expire_loop(), name=f"handoff-expiry-{self.node}")

    async def close(self) -> None:
        self._closed = True
        self.directory.events.unlisten(self._on_stored)
        await self.layers.close()
        tasks = [t for t in (self._sweeper, *(t for o in self._open.values() for t in o.tasks)) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._open.clear()
        self._by_namespace.clear()

    def __len__(self) -> int:
        return len(self._open)

    # -- on the cluster loop -----------------------------------------------------------
    async def open(self, tenant: str, namespace_id: bytes, handoff_id: bytes, to_node: str, ttl_ms: int, keys: list[bytes],
                   may_push: Callable[[], bool]) -> None:
        """Registers the handoff (again: its decode node, ttl and keys replaced); LimitExceeded
        past ``per_tenant`` open handoffs of the tenant (nothing registered)."""
        key = (tenant, namespace_id, handoff_id)
        if key not in self._open and sum(1 for k in self._open if k[0] == tenant) >= self.per_tenant:
            raise LimitExceeded(f"tenant {tenant!r} has {self.per_tenant} open handoffs at node {self.node}; complete some")
        out = self._open.get(key)
        expires = time.monotonic() + ttl_ms / 1000
        if out is None:
            out = self._open[key] = Outgoing(tenant, namespace_id, handoff_id, to_node, ttl_ms, expires, keys, may_push)
            self._by_namespace.setdefault(namespace_id, set()).add(key)
            if to_node and to_node != self.node:
                self._track(out, asyncio.create_task(self._announce(out)))
        else:
            out.to_node, out.ttl_ms, out.expires, out.keys, out.may_push = to_node, ttl_ms, expires, keys, may_push
        self._kick(out)  # pages stored before the open go now

    def _direct(self, tenant: str, namespace_id: bytes) -> list[Outgoing]:
        """The handoffs open here of ``tenant`` in the namespace whose pages go to another node."""
        return [out for key in self._by_namespace.get(namespace_id, ()) if key[0] == tenant
                and (out := self._open[key]).to_node and out.to_node != self.node and not out.failed]

    async def layers_written(self, tenant: str, allocation_id: bytes, slots: WrittenSlots, layers: int) -> None:
        """A layer-wise save's writer stored the leading ``layers`` of its pages (layer_pushes.py)."""
        self.layers.written(tenant, allocation_id, slots, layers)

    def _forget(self, key: OpenKey) -> Outgoing | None:
        out = self._open.pop(key, None)
        if out is not None:
            keys = self._by_namespace.get(key[1], set())
            keys.discard(key)
            if not keys:
                self._by_namespace.pop(key[1], None)
        return out

    def _kick(self, out: Outgoing) -> None:
        """Pushes what was stored since the last push, now, unless ``MAX_PUSHES`` are in flight
        (the first to end kicks again). None once ``close`` began: the end of a push it cancels, or a
        publish handed to the loop before it, would start a Push that nothing cancels or awaits."""
        if self._closed or not out.to_node or out.to_node == self.node or out.failed or not out.keys or len(out.tasks) >= MAX_PUSHES:
            return
        stored = out.queued + self.remote.local_prefix(out.namespace_id, out.keys[out.queued :])
        stored = self.layers.whole(out, out.queued, stored)  # no Push names part of a landing's allocation
        if stored <= out.queued or not out.may_push():
            return
        start, out.queued = out.queued, stored
        self._track(out, asyncio.create_task(self._push(out, start, stored)))

    def _track(self, out: Outgoing, task: asyncio.Task[None]) -> None:
        out.tasks.add(task)
        task.add_done_callback(lambda done: self._pushed(out, done))

    async def _announce(self, out: Outgoing) -> None:
        """Tells the decode node that pages will be pushed to it (a Push without keys): its
        marker is made now, so that a wait starting before the first page lands sleeps until
        it does, instead of pulling the same pages through the pool beside the push."""
        try:
            await self._send(out, [], complete=False, timeout_s=self.rpc_timeout_s)
        except TierUnavailable as exc:
            logger.info("handoff %s: no announce to %s (%s)", out.handoff_id.hex()[:8], out.to_node, exc)

    async def _push(self, out: Outgoing, start: int, end: int) -> None:
        batch = out.keys[start:end]
        try:
            held = await self._send(out, batch, complete=False, timeout_s=self.rpc_timeout_s + 5)
        except TierUnavailable as exc:
            logger.info("handoff %s: push to %s failed (%s); Complete sends the rest", out.handoff_id.hex()[:8], out.to_node, exc)
            held = 0
        if held < len(batch):
            out.failed = True
            return
        out.answered[start] = end
        while out.sent in out.answered:
            out.sent = out.answered.pop(out.sent)

    def _pushed(self, out: Outgoing, task: asyncio.Task[None]) -> None:
        out.tasks.discard(task)
        _logged(task)
        if self._open.get((out.tenant, out.namespace_id, out.handoff_id)) is out:
            self._kick(out)  # pages stored while the calls were all in flight

    async def complete(self, tenant: str, namespace_id: bytes, handoff_id: bytes, keys: list[bytes], to_node: str,
                       timeout_s: float) -> int:
        """Ends the handoff here; returns the leading pages of ``keys`` the decode node holds
        (through the pool, ``to_node`` and the open's both empty: the leading pages stored here).
        ``keys`` empty (the prefill was aborted, or nothing of it is of use): nothing is handed
        off, and the decode node lets go of what was pushed to it now. Keys whose first page is
        not stored here (evicted or lost): the decode node completes the handoff with what was
        pushed to it before (a decode waiting on it answers now, not at its deadline, DESIGN §12.7)."""
        out = self._forget((tenant, namespace_id, handoff_id))
        deadline = time.monotonic() + timeout_s
        to_node = to_node or (out.to_node if out is not None else "")
        if out is not None and out.tasks:  # the pushes in flight land first (the decode node would fetch their pages twice)
            _, late = await asyncio.wait(set(out.tasks), timeout=max(0.01, timeout_s / 2)) if keys else (None, out.tasks)
            for task in late:
                task.cancel()
        try:
            stored = self.remote.local_prefix(namespace_id, keys)
            if not to_node:
                return stored
            target = out or Outgoing(tenant, namespace_id, handoff_id, to_node, DEFAULT_TTL_MS, 0.0, keys, lambda: True)
            target.to_node = to_node
            if not keys:
                await self._abandon(target, max(0.01, deadline - time.monotonic()))
                return 0
            # none here now: every key named, so the decode node completes with the leading ones it holds
            return await self._send(target, keys[:stored] or keys, complete=True, timeout_s=max(0.01, deadline - time.monotonic()))
        finally:
            self.layers.forget((tenant, namespace_id, handoff_id))  # after the last send: it finishes their layers

    async def _abandon(self, out: Outgoing, timeout_s: float) -> None:
        """A complete without pages: the decode node drops the marker and its pins (a decode node
        that cannot be told keeps them until the handoff's ttl)."""
        try:
            await self._send(out, [], complete=True, timeout_s=timeout_s)
        except TierUnavailable as exc:
            logger.info("handoff %s: nothing handed off, %s not told (%s); its pins go at the ttl", out.handoff_id.hex()[:8],
                        out.to_node, exc)

    async def _send(self, out: Outgoing, keys: list[bytes], complete: bool, timeout_s: float) -> int:
        peer = self.peers.get(out.to_node)
        if peer is None:
            raise TierUnavailable(f"handoff decode node {out.to_node!r} is not a live member of the cluster; "
                                  "the pages stay here, findable through the pool")
        if keys:
            await self.layers.settle(out)  # the layers on their way land first: the decode node finishes their pages
        request = handoff_pb2.PushHandoffRequest(namespace_id=out.namespace_id, handoff_id=out.handoff_id, keys=keys,
                                                 holder=self.node, tenant=out.tenant,
                                                 page_bytes=self._page_bytes(keys[0]) if keys else 0,
                                                 complete=complete, ttl_ms=out.ttl_ms)
        try:
            answer = await handoff_pb2_grpc.HandoffStub(peer.channel).Push(request, timeout=timeout_s)
        except asyncio.CancelledError:
            if current_cancelled():
                raise
            raise TierUnavailable(f"handoff decode node {out.to_node!r} left the cluster during the push") from None
        except Exception as exc:  # noqa: BLE001 - any failure of the peer is the same answer to the caller
            raise TierUnavailable(f"handoff decode node {out.to_node!r} did not take {len(keys)} pages: {exc!r}; "
                                  "the pages stay here, findable through the pool") from None
        held = min(len(keys), int(answer.num_pages))
        self.num_pushed += held
        return held

    def _page_bytes(self, key: bytes) -> int:
        entry = self.directory.get(key)
        sizes = [loc.size_bytes for (node, _), loc in list(entry.locations.items()) if node == self.node] if entry else []
        return sizes[0] if sizes else 0

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for key in [k for k, o in self._open.items() if o.expires <= now]:
                out = self._forget(key)
                self.layers.forget(key)
                for task in out.tasks if out is not None else ():
                    task.cancel()
                logger.info("open handoff %s expired without Complete", key[2].hex()[:8])

    # -- the publishing thread ----------------------------------------------------------
    def _on_stored(self, namespace_id: bytes, nodes: frozenset[str]) -> None:
        """Pages stored here in a namespace with open handoffs: handed to the loop (once while
        one is pending). Called on the publishing thread (``EventLog.listen``), after the pages
        are in the directory: an open registered after this check kicks and finds them itself. No
        lock: two publishes that both find the namespace not pending hand it on twice (a kick more);
        one that finds it pending has its pages read by that kick, which discards it first."""
        if self._closed or self.node not in nodes or namespace_id not in self._by_namespace or namespace_id in self._pending:
            return
        self._pending.add(namespace_id)
        try:
            self._loop.call_soon_threadsafe(self._stored, namespace_id)
        except RuntimeError:  # the loop closed: the node is leaving
            pass

    def _stored(self, namespace_id: bytes) -> None:
        self._pending.discard(namespace_id)  # before the kicks: a publish from now on is handed on again
        for key in list(self._by_namespace.get(namespace_id, ())):
            if (out := self._open.get(key)) is not None:
                self._kick(out)


def _logged(task: asyncio.Task[None]) -> None:
    """A push task's unexpected failure, logged (a failed push is no loss: Complete sends the full set)."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        logger.error("handoff push failed", exc_info=exc)
