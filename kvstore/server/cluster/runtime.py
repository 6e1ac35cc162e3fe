"""Cluster mode inside a server process (DESIGN §12): membership on etcd, this node's records
published to their shard owners, lookups across owners, remote pages fetched into the host
tier, namespace invalidations from etcd.

Everything cluster-side runs on one asyncio loop in a thread of its own ("cluster"); the
gRPC servicers (threads) call in through ``lookup`` / ``fill`` / ``invalidate``, each bounded
by a deadline. Membership listeners run on that loop and hand blocking work (dropping a dead
node's records, clearing a namespace) to worker threads.

What changes on a membership change: the shard map (owners of each page's record), the
peers (a channel and a fetcher per node), the records of nodes that left or re-registered
(dropped: they republish), and this node's records whose owners changed (republished).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvstore.cluster.errors import CoordinatorUnavailable
from kvstore.cluster.etcd import EtcdClient, parse_endpoints
from kvstore.cluster.grants import TransferGrants
from kvstore.cluster.members import Invalidation, Member, MembershipConfig, MemberState
from kvstore.cluster.membership import Membership
from kvstore.cluster.shards import ShardConfig, ShardMap
from kvstore.config import ServerConfig
from kvstore.errors import KVStoreError, TierUnavailable
from kvstore.server.cluster.incarnations import Incarnations
from kvstore.server.cluster.lookup import ShardedLookup
from kvstore.server.cluster.peers import Peers
from kvstore.server.cluster.publisher import Publisher
from kvstore.server.cluster.remote import RemoteTier
from kvstore.server.cluster.replicas import Replicas
from kvstore.server.placement import Placement
from kvstore.types import LocationRun

logger = logging.getLogger(__name__)

T = TypeVar("T")
_MARGIN_S = 0.25  # of a caller's deadline, kept for the answer to reach it
MAX_PREFETCHES = 4  # hinted remote fetches in flight at once
_ABORT_S = 3.0    # a cancelled fetch's bounded clean-up (the transport waits up to 2 s for posted receives)


class AppliedInvalidations:
    """The etcd revision of the last namespace invalidation applied here, per namespace, in
    a small file: invalidations are delivered again after every restart, and one applied
    already must not clear pages stored since."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        try:
            self._revs: dict[str, int] = {k: int(v) for k, v in json.loads(path.read_text()).items()}
        except FileNotFoundError:
            self._revs = {}
        except (ValueError, AttributeError) as exc:
            logger.warning("%s is unreadable (%r); applying every invalidation again", path, exc)
            self._revs = {}

    def applied(self, inv: Invalidation) -> bool:
        return self._revs.get(inv.namespace_id.hex(), 0) >= inv.revision

    def record(self, namespace_id: bytes, revision: int) -> None:
        """Thread-safe: the Invalidate servicer and the watch's worker may record at once
        (the issuing node gets its own invalidation back)."""
        key = namespace_id.hex()
        with self._lock:
            self._revs[key] = max(self._revs.get(key, 0), revision)
            tmp = self._path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._revs))
            os.replace(tmp, self._path)


class ClusterRuntime:
    def __init__(self, core: Placement, config: ServerConfig) -> None:
        assert config.cluster is not None
        self.core = core
        self.config = config
        self.cluster = config.cluster
        self.node = config.node
        self.shard_config = ShardConfig(segment_pages=1, replicas=self.cluster.replicas)  # per-page owners: see lookup.py
        self.shard_map = ShardMap([], self.shard_config)
        self.invalidations = AppliedInvalidations(config.data_dir / "cluster-invalidations.json")
        self.incarnations = Incarnations(lambda: core.directory.version)  # of the other nodes, heard as their owner
        self._members: dict[str, Member] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cluster", daemon=True)
        self._tasks: set[asyncio.Future[Any]] = set()
        self._page_server: Any = None
        self.grants: TransferGrants | None = None  # with the UCX or TCP data plane: what GrantTransfer hands out
        self._prefetch_lock = threading.Lock()
        self._leaving = False
        self._prefetching = 0
        self.membership: Membership | None = None
        self.publisher: Publisher | None = None
        # namespace -> its tenant here (the server's tenancy sets it): named in what this node publishes
        self.owner_of: Callable[[bytes], str | None] = lambda namespace_id: None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout_s: float | None = None) -> None:
        """Starts the loop, the page server, joins the cluster and publishes what this node
        holds; returns once it is a member (CoordinatorUnavailable after ``timeout_s``,
        by default 3 TTLs: a restarted node waits for its previous lease to expire)."""
        timeout_s = timeout_s or max(10.0, 3.0 * self.cluster.ttl_s)
        self._thread.start()
        try:
            self.call(self._start(timeout_s), timeout_s + 5)
        except TimeoutError:
            raise CoordinatorUnavailable(f"could not join the cluster at {self.cluster.etcd} as node {self.node} "
                                         f"within {timeout_s:.0f} s (etcd down? the node id still registered?)") from None

    async def _start(self, timeout_s: float) -> None:
        cluster = self.cluster
        ucx, data_address = None, ""
        if cluster.data_plane == "ucx":
            from kvstore.cluster.transport_ucx import UcxConfig, UcxPageServer
            from kvstore.server.cluster.source import SEND_TIMEOUT_S, CorePageSource

            ucx = UcxConfig(tls=cluster.ucx_tls, progress_mode="thread")
            self.grants = TransferGrants()  # the data port serves only connections granted over gRPC (node right)
            self._page_server = UcxPageServer(CorePageSource(self.core), ucx, port=cluster.data_port, authorize=self.grants.take,
                                             send_timeout_s=SEND_TIMEOUT_S)
            data_address = f"{cluster.advertise.rpartition(':')[0]}:{await self._page_server.start()}"
        elif cluster.data_plane == "tcp":
            from kvstore.cluster.transport_tcp import TcpPageServer
            from kvstore.server.cluster.source import SEND_TIMEOUT_S, CorePageSource

            self.grants = TransferGrants()  # as for UCX: the port serves only connections granted over gRPC
            host = cluster.advertise.rpartition(":")[0]
            self._page_server = TcpPageServer(CorePageSource(self.core), host=host.strip("[]"), port=cluster.data_port,
                                              send_timeout_s=SEND_TIMEOUT_S, authorize=self.grants.take)
            data_address = f"{host}:{await self._page_server.start()}"
        self.etcd = EtcdClient(parse_endpoints(cluster.etcd))
        self.peers = Peers(self.node, cluster, self.config.security, ucx)
        self.lookups = ShardedLookup(self.core.directory, self.node, self.peers, lambda: self.shard_map, cluster.rpc_timeout_s,
                                     cluster.ttl_s)
        self.remote = RemoteTier(self.core, self.peers, self.lookups, cluster.data_plane)
        self.publisher = Publisher(self.core.directory, self.node, self.peers, lambda: self.shard_map, cluster.rpc_timeout_s,
                                   is_member=lambda: self.is_member, tenant_of=lambda ns: self.owner_of(ns) or "",
                                   epoch=lambda: self.membership.epoch if self.membership is not None else 0)
        self.replicas = Replicas(self.node, self.remote, self.peers, lambda: self._members, cluster.rpc_timeout_s)
        capacities = {"host": self.config.host.capacity_bytes}
        if self.config.ssd is not None:
            capacities["ssd"] = self.config.ssd.capacity_bytes
        me = Member(self.node, cluster.advertise, data_address, tuple(self.config.tiers), capacities)
        self.membership = Membership(self.etcd, MembershipConfig(cluster.name, self.node, cluster.ttl_s), me)
        self.membership.on_members(self._on_members)
        self.membership.on_invalidate(self._on_invalidate)
        self.membership.on_state(self._on_state)
        await self.membership.start(timeout_s)
        self.publisher.start()
        logger.info("node %s joined cluster %s (epoch %d, data plane %s%s)", self.node, cluster.name, self.membership.epoch,
                    cluster.data_plane, f" on {data_address}" if data_address else "")

    def stop(self) -> None:
        """Leaves the cluster (the lease is revoked: the others drop this node's records at
        once) and stops the loop."""
        if not self._thread.is_alive():
            return
        self._leaving = True  # calls still arriving answer from this node alone
        try:
            self.call(self._stop(), 15)
        except (TimeoutError, KVStoreError) as exc:
            logger.warning("leaving the cluster did not finish: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _stop(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
        if self.membership is not None:
            await self.membership.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.peers.close()
        if self._page_server is not None:
            await self._page_server.close()
        await self.etcd.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Runs ``coro`` on the cluster loop from another thread; cancels it past ``timeout_s``."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("cluster task failed", exc_info=exc)

    # -- what the servicers call ---------------------------------------------------------
    @property
    def is_member(self) -> bool:
        """Whether this node acts as a member now: registered, its lease not lost (DESIGN §12:
        a node that lost it would be split-brained), not leaving."""
        return self.membership is not None and self.membership.is_member and not self._leaving

    def own_lookup(self, namespace_id: bytes, keys: list[bytes]) -> list[LocationRun]:
        """The prefix of ``keys`` this node holds itself (a local copy is always the best location)."""
        runs = self.core.directory.lookup(namespace_id, keys)
        return runs[: next((i for i, r in enumerate(runs) if r.node != self.node), len(runs))]

    def owner_lookup(self, namespace_id: bytes, keys: list[bytes]) -> list[LocationRun]:
        """What a node asking this one as a shard owner gets: every record here while a member,
        only this node's own pages otherwise (the records it holds as an owner may be stale)."""
        return self.core.directory.lookup(namespace_id, keys) if self.is_member else self.own_lookup(namespace_id, keys)

    def lookup(self, namespace_id: bytes, keys: list[bytes], time_remaining_s: float | None, tenant: str = "") -> list[LocationRun]:
        """The contiguous prefix of ``keys`` stored anywhere in the cluster, as runs; only this
        node's own pages while it is not a member. ``tenant``: the caller's, named to the owners."""
        if not self.is_member:
            return self.own_lookup(namespace_id, keys)
        timeout = self.cluster.rpc_timeout_s if time_remaining_s is None else max(0.01, time_remaining_s - _MARGIN_S)
        try:
            return self.call(self.lookups.lookup(namespace_id, keys, timeout, tenant), timeout + 1)
        except TimeoutError:
            return self.owner_lookup(namespace_id, keys)

    def fill(self, namespace_id: bytes, keys: list[bytes], time_remaining_s: float | None, tenant: str = "") -> int:
        """Fetches the pages of ``keys`` held only elsewhere into the host tier (up to the
        first that cannot be had), within the caller's deadline; then an acquire finds them.
        Returns how many pages this added to the leading ones held here (none while not a member)."""
        before = self.remote.local_prefix(namespace_id, keys)
        if not self.is_member or before == len(keys):
            return 0
        timeout = self.cluster.fetch_timeout_s
        if time_remaining_s is not None:
            timeout = min(timeout, time_remaining_s - _MARGIN_S - _ABORT_S)
        if timeout <= 0:
            return 0
        try:
            return max(0, self.call(self.remote.read_into_landing(namespace_id, keys, timeout, tenant), timeout + _ABORT_S) - before)
        except (TimeoutError, KVStoreError) as exc:
            logger.warning("remote fill of %d pages ended early: %r", len(keys), exc)
            return max(0, self.remote.local_prefix(namespace_id, keys) - before)

    def replicate(self, namespace_id: bytes, keys: list[bytes], replicas: int, time_remaining_s: float | None,
                  tenant: str = "") -> int:
        """Has other members copy the leading pages of ``keys`` held here until ``replicas``
        nodes hold them (replicas.py); returns how many leading pages that many nodes hold."""
        if not self.is_member:
            return self.remote.local_prefix(namespace_id, keys) if replicas <= 1 else 0
        # the targets' own fetch deadline is this one less their margins (see _timeout)
        budget = self.cluster.fetch_timeout_s + _ABORT_S + 2 * _MARGIN_S
        if time_remaining_s is not None:
            budget = min(budget, time_remaining_s - _MARGIN_S)
        try:
            return self.call(self.replicas.replicate(namespace_id, keys, replicas, max(0.01, budget), tenant), budget + 1)
        except TimeoutError:
            return 0

    def copy_from(self, holder: str, namespace_id: bytes, keys: list[bytes], page_bytes: int, time_remaining_s: float | None,
                  tenant: str = "") -> int:
        """A replica ``holder`` asked for: fetches ``keys`` from it; returns the leading pages held here."""
        if not self.is_member:
            return self.remote.local_prefix(namespace_id, keys)
        timeout = self._timeout(time_remaining_s)
        try:
            return self.call(self.remote.fetch_from(holder, namespace_id, keys, page_bytes, timeout, tenant), timeout + _ABORT_S)
        except (TimeoutError, KVStoreError) as exc:
            logger.warning("replica of %d pages from %s ended early: %r", len(keys), holder, exc)
            return self.remote.local_prefix(namespace_id, keys)

    def _timeout(self, time_remaining_s: float | None) -> float:
        timeout = self.cluster.fetch_timeout_s
        if time_remaining_s is not None:
            timeout = min(timeout, time_remaining_s - _MARGIN_S - _ABORT_S)
        return max(0.01, timeout)

    def prefetch(self, namespace_id: bytes, keys: list[bytes], tenant: str = "") -> bool:
        """Starts fetching the pages of ``keys`` held only elsewhere (a hint: a queued
        request will need them) and returns at once; False when ``MAX_PREFETCHES`` are in
        flight already (the engine then recomputes or reads them on demand)."""
        if not self.is_member:
            return False
        if self.remote.local_prefix(namespace_id, keys) == len(keys):
            return True
        with self._prefetch_lock:
            if self._prefetching >= MAX_PREFETCHES:
                return False
            self._prefetching += 1
        # a task of the runtime: cancelled (its allocation given back) when the node leaves
        self._loop.call_soon_threadsafe(self._spawn, self._prefetch(namespace_id, keys, tenant))
        return True

    async def _prefetch(self, namespace_id: bytes, keys: list[bytes], tenant: str) -> None:
        try:
            await self.remote.read_into_landing(namespace_id, keys, self.cluster.fetch_timeout_s, tenant)
        except KVStoreError as exc:
            logger.info("prefetch of %d remote pages ended early: %r", len(keys), exc)
        finally:
            with self._prefetch_lock:
                self._prefetching -= 1

    def invalidate(self, namespace_id: bytes) -> None:
        """Writes a namespace invalidation to etcd: every node clears the namespace."""
        assert self.membership is not None
        if self._leaving:
            raise TierUnavailable(f"namespace {namespace_id.hex()} was cleared on node {self.node}, which is leaving "
                                  "the cluster: invalidate it again at another node")
        try:
            inv = self.call(self.membership.invalidate(namespace_id), self.etcd.call_timeout_s + 1)
        except (CoordinatorUnavailable, TimeoutError) as exc:
            raise TierUnavailable(f"namespace {namespace_id.hex()} was cleared on node {self.node} but etcd did not take "
                                  f"the invalidation ({exc!r}); the other nodes still hold it: invalidate again") from None
        self.invalidations.record(namespace_id, inv.revision)

    # -- membership listeners (on the loop) -------------------------------------------------
    def _on_members(self, members: Mapping[str, Member]) -> None:
        before, self.shard_map = self.shard_map, ShardMap(members, self.shard_config)
        self._members = dict(members)
        for peer in self.peers.update(members):
            self._spawn(peer.close())
        # nodes that left or registered again: the records a newer incarnation published (maybe before this was heard) stay
        for node, up_to_version in self.incarnations.watched({n: m.epoch for n, m in members.items() if n != self.node}):
            self._spawn(self._drop(node, up_to_version))
        if self.publisher is not None:
            self.publisher.members_changed(before, self.shard_map)

    async def _drop(self, node: str, up_to_version: int) -> None:
        self.lookups.cache.forget_node(node)
        gone = await asyncio.to_thread(self.core.directory.drop_node, node, up_to_version)
        logger.info("node %s left the cluster (or re-registered): %d of its records dropped", node, gone)

    def _on_state(self, state: MemberState, epoch: int) -> None:
        if state is MemberState.MEMBER and epoch > 1 and self.publisher is not None:
            self.publisher.republish_all()  # the others dropped this node's records with its old epoch

    def _on_invalidate(self, inv: Invalidation) -> None:
        if not self.invalidations.applied(inv):
            self._spawn(self._invalidate(inv))

    async def _invalidate(self, inv: Invalidation) -> None:
        removed = await asyncio.to_thread(self.core.invalidate, inv.namespace_id, [])
        self.invalidations.record(inv.namespace_id, inv.revision)
        logger.info("namespace %s invalidated by node %s: %d pages dropped here", inv.namespace_id.hex(), inv.issued_by, removed)
