"""The cluster half of live migration (DESIGN §12.8): etcd's session records, read and decided from
the servicer's threads on the cluster loop, and reconciled at every catch-up.

More: kvstore/server/cluster/README.md (### migrations.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kvstore.cluster.cluster_errors import CoordinatorUnavailable
from kvstore.cluster.session_records import EtcdSessions, SessionRecord
from kvstore.errors import KVStoreError
from kvstore.server.session_owners import FENCED, FREEZING, INCOMING, OWNED, Ownership, SessionOwners
from kvstore.server.tokenlog import TokenLog

if TYPE_CHECKING:
    from kvstore.server.cluster import ClusterRuntime

logger = logging.getLogger(__name__)

MARK_RETRY_MAX_S = 5.0  # the longest wait between tries to tell etcd a session was adopted here


class SessionMoves:
    def __init__(self, cluster: ClusterRuntime, owners: SessionOwners, wal: TokenLog) -> None:
        self._cluster = cluster
        self._owners = owners
        self._wal = wal
        self.node = cluster.node
        self._etcd: EtcdSessions | None = None

    @property
    def etcd(self) -> EtcdSessions:
        if self._etcd is None:
            assert self._cluster.membership is not None, "the cluster runtime has not started"
            self._etcd = EtcdSessions(self._cluster.etcd, self._cluster.membership.config.root, self.node)
        return self._etcd

    def _timeout_s(self) -> float:
        return max(2.0, self._cluster.cluster.rpc_timeout_s)

    def decide(self, namespace_id: bytes, session_id: str, version: int, owner: str) -> SessionRecord:
        """etcd's compare-and-swap of ``version`` for ``owner``; the record etcd holds afterwards.
        CoordinatorUnavailable (UNAVAILABLE) when etcd does not answer: nothing is known decided."""
        timeout = self._timeout_s()
        return self._cluster.call(self.etcd.decide(namespace_id, session_id, version, owner), timeout + 1)

    def read(self, namespace_id: bytes, session_id: str) -> SessionRecord | None:
        timeout = self._timeout_s()
        return self._cluster.call(self.etcd.read(namespace_id, session_id), timeout + 1)

    def adopted(self, namespace_id: bytes, session_id: str, version: int) -> None:
        """This node adopted ``version`` of the session: etcd is told, for the node it was fenced
        from (its log can go), in the background and until etcd answers: not on the migration's pause."""
        self._cluster.submit(self._mark_adopted(namespace_id, session_id, version))

    async def _mark_adopted(self, namespace_id: bytes, session_id: str, version: int) -> None:
        wait = 0.1
        while True:
            try:  # asyncio.timeout, not 3.11's wait_for: that swallows a leave's cancel arriving as etcd answers,
                # and an error then kept this task of the runtime retrying while the leave waited on it (DESIGN §12.8)
                async with asyncio.timeout(self._timeout_s()):
                    await self.etcd.adopt(namespace_id, session_id, version, self.node)
                return
            except (CoordinatorUnavailable, TimeoutError) as exc:
                logger.info("session %r: etcd not told yet that version %d was adopted here (%r); retrying", session_id,
                            version, exc)
            await asyncio.sleep(wait)
            wait = min(MARK_RETRY_MAX_S, 2 * wait)

    def release_adopted(self) -> None:
        """The sessions fenced here that their target adopted (or that moved on since): their logs
        may idle out. Those etcd does not say so of (or does not answer for) stay kept."""
        fenced = self._owners.fenced()
        if not fenced or not self._cluster.serving:
            return
        try:
            for ns, sid, mine in fenced:
                if not self._wal.has(ns, sid):
                    self._owners.release(ns, sid, mine.version)  # no log here to keep
                    continue
                record = self.read(ns, sid)
                if record is not None and (record.version > mine.version or (record.adopted and record.version == mine.version)):
                    self._owners.release(ns, sid, mine.version)
        except (KVStoreError, TimeoutError, RuntimeError) as exc:  # etcd down; the node leaving (its loop closed)
            logger.info("etcd did not say which fenced sessions were adopted (%r); their logs stay for now", exc)

    def is_member(self, node: str) -> bool:
        """Whether etcd lists ``node`` now (its lease alive: it may be serving)."""
        assert self._cluster.membership is not None
        _, registered = self._cluster.call(self._cluster.membership.registered(), self._timeout_s() + 1)
        return node in registered

    def address_of(self, node: str) -> str:
        peer = self._cluster.peers.get(node) if node != self.node else None
        return peer.member.grpc_address if peer is not None else ""

    def reconcile(self) -> None:
        """Runs in a worker thread of the catch-up (etcd is reached through the cluster loop);
        CoordinatorUnavailable when etcd does not answer in time (the catch-up retries)."""
        try:
            self._reconcile()
        except TimeoutError:
            raise CoordinatorUnavailable("etcd did not answer the sessions' catch-up in time") from None

    def _reconcile(self) -> None:
        held = {(ns, sid): record for ns, sid, record in self._cluster.call(self.etcd.read_all(), self._timeout_s() + 1)}
        for (ns, sid), record in held.items():
            mine = self._owners.get(ns, sid)
            if mine is None and self._wal.read(ns, sid) is None:
                continue  # a session never here
            if mine is not None and record.version <= mine.version:
                continue  # known here (FREEZING: the version the fence starts from; nothing decided above it)
            if record.owner == self.node:
                if mine is None or mine.state != INCOMING:  # INCOMING: served once the migration adopts it
                    self._owners.put(ns, sid, Ownership(record.version, OWNED, self.node))
                continue
            self._owners.put(ns, sid, Ownership(record.version, FENCED, record.owner))
            logger.warning("session %r of namespace %s moved to node %s (version %d) while this node was away: "
                           "fenced here", sid, ns.hex(), record.owner, record.version)
        for ns, sid, mine in self._owners.items():
            if mine.state in (OWNED, FENCED) or (mine.state == FREEZING and mine.version > 0):
                owner = mine.node if mine.state == FENCED else self.node
                record = held.get((ns, sid), SessionRecord(0, ""))
                if record.version < mine.version:
                    record = self._cluster.call(self.etcd.decide(ns, sid, mine.version, owner), self._timeout_s() + 1)
                    logger.warning("etcd lacked session %r's version %d (replaced or restored?): written back", sid,
                                   mine.version)
                if mine.state == OWNED and record == SessionRecord(mine.version, self.node):  # adopted here, not said
                    self._cluster.call(self.etcd.adopt(ns, sid, mine.version, self.node), self._timeout_s() + 1)
