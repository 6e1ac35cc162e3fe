"""This node's page locations, published to the shard owners of each page's record.

More: kvstore/server/cluster/README.md (### publisher.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvstore._proto import common_pb2, directory_pb2
from kvstore.cluster.shards import ShardMap, moves
from kvstore.directory import Directory
from kvstore.directory.events import EventKind
from kvstore.server.cluster.peers import Peers, current_cancelled
from kvstore.status import ERROR_METADATA_KEY, error_class

logger = logging.getLogger(__name__)

_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# refused because the owner's watch has not yet heard of this node's new incarnation (a node registered
# anew in a replaced etcd, below the epoch the owner remembers): retried until the owner's watch says so; or
# because the owner registered again since this node heard of it: retried until this node's watch says so
_RETRIED_ERRORS = ("StaleIncarnation",)

BATCH_RECORDS = 4096
FLUSH_S = 0.02  # how long changes gather before they are sent
RETRY_S = 0.2  # before a failed send is tried again


@dataclass(frozen=True)
class Record:
    key: bytes
    namespace_id: bytes
    tier: str
    size_bytes: int
    generation: int = 0


# (key, tier) -> (its record, True: publish it / False: withdraw it)
Change = dict[tuple[bytes, str], tuple[Record, bool]]


class Publisher:
    def __init__(self, directory: Directory, node: str, peers: Peers, shard_map: Callable[[], ShardMap],
                 timeout_s: float, is_member: Callable[[], bool] = lambda: True,
                 tenant_of: Callable[[bytes], str] = lambda namespace_id: "", epoch: Callable[[], int] = lambda: 0) -> None:
        self._directory = directory
        self._node = node
        self._peers = peers
        self._shard_map = shard_map
        self._timeout_s = timeout_s
        self._is_member = is_member
        self._tenant_of = tenant_of
        self._epoch = epoch  # named in every call: an owner refuses a late one of an incarnation that is over
        self._held: dict[tuple[bytes, str], Record] = {}
        self._pending: dict[str, Change] = {}  # owner -> its changes not sent yet
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=f"publish-{node}", daemon=True)
        self._task: asyncio.Task[None] | None = None
        self.started = False
        self.num_published = 0
        self.num_withdrawn = 0

    def start(self) -> None:
        """Publishes every location this node holds now (its SSD pages after a restart), then
        follows the changes."""
        self._next_seq = self._directory.events.last_seq + 1
        self.started = True
        self._resync()
        self._thread.start()
        self._task = asyncio.create_task(self._flush_loop(), name=f"publish-flush-{self._node}")

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._thread.ident is not None:  # started: a node that never joined closes it too
            await asyncio.to_thread(self._thread.join, 2.0)

    # -- what this node holds ------------------------------------------------------------
    def _follow(self) -> None:
        """The event thread: this node's own location changes, handed to the loop."""
        events = self._directory.events
        while not self._stop.is_set() and not events.closed:
            batch = events.wait_since(self._next_seq, 0.5)
            if not batch:
                continue
            self._next_seq = batch[-1].seq + 1
            changes: list[tuple[EventKind, bytes, bytes, str, int, int]] = []
            for ev in batch:
                if ev.kind in (EventKind.RESYNC, EventKind.CLEARED):
                    changes.append((ev.kind, ev.namespace_id, b"", "", 0, ev.generation))
                elif ev.location is not None and ev.location.node == self._node:
                    changes.append((ev.kind, ev.namespace_id, ev.key, ev.location.tier, ev.location.size_bytes, ev.generation))
            if changes:
                try:
                    self._loop.call_soon_threadsafe(self._apply, changes)
                except RuntimeError:  # the loop closed: the node is leaving
                    return

    def _apply(self, changes: list[tuple[EventKind, bytes, bytes, str, int, int]]) -> None:
        shard_map = self._shard_map()
        for kind, ns, key, tier, size, generation in changes:
            if kind is EventKind.RESYNC:
                self._resync()
            elif kind is EventKind.CLEARED:
                # every owner drops the older generation's records itself when it enters the new one
                for held in [h for h, r in self._held.items() if r.namespace_id == ns and r.generation < generation]:
                    del self._held[held]
                for changes_of_owner in self._pending.values():
                    for held in [h for h, (r, _) in changes_of_owner.items() if r.namespace_id == ns and r.generation < generation]:
                        del changes_of_owner[held]
            elif kind is EventKind.STORED:
                record = Record(key, ns, tier, size, generation)
                self._held[(key, tier)] = record
                self._queue(shard_map, record, True)
            elif kind is EventKind.REMOVED and (record := self._held.pop((key, tier), None)) is not None:
                self._queue(shard_map, record, False)

    def republish_all(self) -> None:
        """Publishes every record again (this node re-registered: the others dropped them)."""
        self._resync()

    def republish_to(self, owners: list[str]) -> None:
        """Publishes again every record ``owners`` own (they registered anew: what they kept is gone)."""
        if not owners:
            return
        shard_map, wanted = self._shard_map(), set(owners)
        for record in self._held.values():
            gained = tuple(o for o in shard_map.owners(record.key) if o in wanted)
            if gained:
                self._queue(shard_map, record, True, gained)

    def _resync(self) -> None:
        shard_map = self._shard_map()
        now = {(k, loc.tier): Record(k, ns, loc.tier, loc.size_bytes, gen)
               for k, ns, loc, gen in self._directory.locations_of(self._node)}
        for held, record in self._held.items():
            if held not in now:
                self._queue(shard_map, record, False)
        self._held = now
        for record in now.values():
            self._queue(shard_map, record, True)

    def _queue(self, shard_map: ShardMap, record: Record, publish: bool, owners: tuple[str, ...] | None = None) -> None:
        for owner in owners if owners is not None else shard_map.owners(record.key):
            if owner != self._node:  # this node's own directory lists its pages already
                self._pending.setdefault(owner, {})[(record.key, record.tier)] = (record, publish)
        self._wake.set()

    def members_changed(self, before: ShardMap, after: ShardMap) -> None:
        """Republishes the records whose owners changed to the new owners; withdraws them
        from the old owners still alive. Changes queued for owners that left are dropped."""
        for owner in [o for o in self._pending if o not in after.members]:
            del self._pending[owner]
        by_key: dict[bytes, list[Record]] = {}
        for (key, _), record in self._held.items():
            by_key.setdefault(key, []).append(record)
        for move in moves(by_key, before, after):
            gained, lost = move.gained, tuple(o for o in move.lost if o in after.members)
            for record in by_key[move.segment_key]:
                self._queue(after, record, True, gained)
                self._queue(after, record, False, lost)

    # -- sending -------------------------------------------------------------------------
    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(FLUSH_S)
            if not self._is_member():
                continue  # held (the wake stays set) until this node is a member again
            self._wake.clear()
            pending, self._pending = self._pending, {}
            try:
                await asyncio.gather(*(self._send(owner, changes) for owner, changes in pending.items()))
            except asyncio.CancelledError:
                if current_cancelled():
                    raise
                logger.warning("publishing records of node %s: a call ended with its channel", self._node)
            except Exception:
                logger.exception("publishing records of node %s failed", self._node)

    async def _send(self, owner: str, changes: Change) -> None:
        peer = self._peers.get(owner)
        if peer is None:
            return  # not (or no longer) a member: the membership change moves its records
        items = list(changes.items())
        sent = 0
        try:
            for start in range(0, len(items), BATCH_RECORDS):
                batch = items[start : start + BATCH_RECORDS]
                await self._send_batch(peer, batch)
                sent = start + len(batch)
        except (asyncio.CancelledError, grpc.aio.UsageError):
            if current_cancelled():
                raise
            # the owner's channel was closed under the call, or before it started (UsageError): it left, or
            # registered anew; this task goes on
            logger.info("node %s: publishing %d records to %s ended with its channel; retrying", self._node,
                        len(items) - sent, owner)
            await self._retry(owner, peer, items[sent:])
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _RETRIED and _error_name(exc) not in _RETRIED_ERRORS:
                # refused (the owner's record limits, rights, a generation that is over): retrying would not change that
                logger.warning("node %s: owner %s refused %d records (%s: %s); they are not listed there",
                               self._node, owner, len(items) - sent, exc.code().name, exc.details())
                return
            logger.info("node %s: publishing %d records to %s failed (%s); retrying", self._node, len(items) - sent, owner,
                        exc.code().name)
            await self._retry(owner, peer, items[sent:])

    async def _retry(self, owner: str, peer: Any, items: list[tuple[tuple[bytes, str], tuple[Record, bool]]]) -> None:
        """Queues ``items`` for ``owner`` again while it is a member (a newer change queued meanwhile wins), as
        long as it is the incarnation they were sent to (``peer``): one that left or registered anew since was
        given what this node holds now, and a change dropped with its leaving must not come back with these."""
        if owner in self._shard_map().members and self._peers.get(owner) is peer:
            retry = self._pending.setdefault(owner, {})
            for held, record in items:
                retry.setdefault(held, record)
            await asyncio.sleep(RETRY_S)
            self._wake.set()

    async def _send_batch(self, peer: Any, batch: list[tuple[tuple[bytes, str], tuple[Record, bool]]]) -> None:
        publish: dict[tuple[bytes, int], list[directory_pb2.PageRecord]] = {}
        withdraw: dict[tuple[bytes, str], list[bytes]] = {}
        for (key, tier), (record, wanted) in batch:
            if wanted:
                loc = common_pb2.Location(node=self._node, tier=tier, size_bytes=record.size_bytes)
                publish.setdefault((record.namespace_id, record.generation), []).append(
                    directory_pb2.PageRecord(key=key, location=loc))
            else:
                withdraw.setdefault((record.namespace_id, tier), []).append(key)
        for (ns, generation), records in publish.items():
            request = directory_pb2.PublishRequest(namespace_id=ns, records=records, tenant=self._tenant_of(ns),
                                                   epoch=self._epoch(), generation=generation, owner_epoch=peer.member.epoch)
            try:
                await peer.directory.Publish(request, timeout=self._timeout_s)
                logger.debug("node %s published %d records of %s (generation %d) to %s, epoch %d", self._node, len(records),
                             ns.hex(), generation, peer.member.node_id, request.epoch)
            except grpc.aio.AioRpcError as exc:
                if _error_name(exc) != "StaleGeneration":
                    raise
                # the owner entered a newer generation: these pages are dead (this node drops them when it does)
                logger.info("node %s: %d records of namespace %s refused by %s: %s", self._node, len(records), ns.hex(),
                            peer.member.node_id, exc.details())
                continue
            self.num_published += len(records)
        for (ns, tier), keys in withdraw.items():
            logger.debug("node %s withdraws %d records of %s from %s", self._node, len(keys), ns.hex(), peer.member.node_id)
            await peer.directory.Remove(directory_pb2.RemoveRequest(namespace_id=ns, keys=keys, tier=tier, node=self._node,
                                                                    epoch=self._epoch(), owner_epoch=peer.member.epoch),
                                        timeout=self._timeout_s)
            self.num_withdrawn += len(keys)


def _error_name(exc: grpc.aio.AioRpcError) -> str:
    """The kvstore error class the owner raised (its trailing metadata), or ""."""
    return next((error_class(str(v)) for k, v in (exc.trailing_metadata() or ()) if k == ERROR_METADATA_KEY), "")
