"""Cluster mode inside a server process (DESIGN §12): membership on etcd, this node's records
published to their shard owners, lookups across owners, remote pages fetched into the host
tier, namespace generations (invalidations) kept with etcd (cluster_generations.py).

Everything cluster-side runs on one asyncio loop in a thread of its own ("cluster", made in ``start``); the gRPC
servicers (threads) call in through ``lookup`` / ``fill`` / ``invalidate``, each bounded by a deadline, or ``submit``
a background task. Membership listeners run on that loop and hand blocking work to worker threads. A membership change
rebuilds the shard map and peers, drops the records of nodes that left or re-registered (they republish), republishes
this node's records whose owners changed. At each catch-up it drops the records the others gave it before it registered.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import CancelledError
from typing import Any, TypeVar

from kvstore.cluster.cluster_errors import CoordinatorUnavailable
from kvstore.cluster.epoch_file import EpochFile
from kvstore.cluster.etcd import EtcdClient, KeyValue, parse_endpoints
from kvstore.cluster.generation_records import EtcdGenerations
from kvstore.cluster.grants import TransferGrants
from kvstore.cluster.members import Member, MembershipConfig, MemberState
from kvstore.cluster.membership import Membership
from kvstore.cluster.shards import ShardConfig, ShardMap
from kvstore.config import ServerConfig
from kvstore.errors import KVStoreError, TierUnavailable
from kvstore.server.cluster.caller_copy import copy_on_caller
from kvstore.server.cluster.cluster_generations import GenerationSync
from kvstore.server.cluster.handoff_push import HandoffPushes
from kvstore.server.cluster.incarnations import Incarnations
from kvstore.server.cluster.lookup import ShardedLookup
from kvstore.server.cluster.loop_calls import run_on
from kvstore.server.cluster.migrations import SessionMoves
from kvstore.server.cluster.peers import Peers
from kvstore.server.cluster.publisher import Publisher
from kvstore.server.cluster.remote import Landing, RemoteTier
from kvstore.server.cluster.replicas import Replicas
from kvstore.server.placement import Placement
from kvstore.server.serving import ServingState
from kvstore.server.session_owners import SessionOwners
from kvstore.server.tokenlog import TokenLog
from kvstore.types import LocationRun

logger = logging.getLogger(__name__)

T = TypeVar("T")
_MARGIN_S = 0.25  # of a caller's deadline, kept for the answer to reach it
MAX_PREFETCHES = 4  # hinted remote fetches in flight at once
# Of a fetch's time, kept past its own deadline for its end (the transport's abort waits up to 2 s for
# posted receives; the commit of what arrived): at most _ABORT_S, and _ABORT_SHARE of a caller's shorter
# deadline (an engine's TTFT budget). A fetch cut there is cancelled; the caller gets what was committed
# once it ended (a commit it started included: to_end).
_ABORT_S, _ABORT_SHARE = 3.0, 0.25


class ClusterRuntime:
    """``state``: whether this node serves, which the core reads and this runtime drives (server/serving.py);
    ``owner_of``: namespace -> its tenant here, named in what this node publishes; ``session_owners`` and ``wal``:
    live migration's records here, reconciled with etcd's (``session_moves``) after ``reseed_salts`` at every catch-up."""

    def __init__(self, core: Placement, config: ServerConfig, state: ServingState, owner_of: Callable[[bytes], str | None],
                 session_owners: SessionOwners, wal: TokenLog, reseed_salts: Callable[[], object] | None = None) -> None:
        assert config.cluster is not None
        self.core = core
        self.config = config
        self.cluster = config.cluster
        self.node = config.node
        self.shard_config = ShardConfig(segment_pages=1, replicas=self.cluster.replicas)  # per-page owners: see lookup.py
        self.shard_map = ShardMap([], self.shard_config)
        self.state = state
        self.owner_of = owner_of
        self._reseed_salts = reseed_salts  # the tenants' salts written back to an etcd that lost them
        self.session_moves = SessionMoves(self, session_owners, wal)  # live migration's etcd side (DESIGN §12.8)
        self.incarnations = Incarnations(lambda: core.directory.version)  # of the other nodes, heard as their owner
        self._members: dict[str, Member] = {}
        self._loop = asyncio.new_event_loop()  # closed until start makes the one that runs (a failed build leaves none open)
        self._loop.close()
        self._thread = threading.Thread(name="cluster", daemon=True)
        self._tasks: set[asyncio.Future[Any]] = set()
        self._page_server: Any = None
        self.grants: TransferGrants | None = None  # with the UCX or TCP data plane: what GrantTransfer hands out
        self._prefetch_lock = threading.Lock()
        self._prefetching = 0
        self.membership: Membership | None = None
        self.publisher: Publisher | None = None
        self.generations: GenerationSync | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout_s: float | None = None) -> None:
        """Makes and starts the loop, the page server, joins the cluster and publishes what this node holds; returns once
        it is a member (CoordinatorUnavailable after ``timeout_s``, by default --cluster-join-timeout-s or 3 TTLs: a
        restarted node waits for its previous lease to expire)."""
        timeout_s = timeout_s or self.cluster.join_timeout_s or max(10.0, 3.0 * self.cluster.ttl_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cluster", daemon=True)
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
            data_address = cluster.data_address(await self._page_server.start())
        elif cluster.data_plane == "tcp":
            from kvstore.cluster.transport_tcp import TcpPageServer
            from kvstore.server.cluster.source import SEND_TIMEOUT_S, CorePageSource

            self.grants = TransferGrants()  # as for UCX: the port serves only connections granted over gRPC
            host = cluster.advertise.rpartition(":")[0]
            self._page_server = TcpPageServer(CorePageSource(self.core), host=host.strip("[]"), port=cluster.data_port,
                                              send_timeout_s=SEND_TIMEOUT_S, authorize=self.grants.take)
            data_address = cluster.data_address(await self._page_server.start())
        self.etcd = EtcdClient(parse_endpoints(cluster.etcd))
        self.peers = Peers(self.node, cluster, self.config.security, ucx)
        capacities = {"host": self.config.host.capacity_bytes}
        if self.config.ssd is not None:
            capacities["ssd"] = self.config.ssd.capacity_bytes
        me = Member(self.node, cluster.advertise, data_address, tuple(self.config.tiers), capacities, ttl_s=cluster.ttl_s)
        config = MembershipConfig(cluster.name, self.node, cluster.ttl_s)
        epochs = EpochFile(self.config.data_dir)
        self.membership = membership = Membership(self.etcd, config, me, epochs)
        self.generations = generations = GenerationSync(self.core, EtcdGenerations(self.etcd, config.root, self.node), membership,
                                                        self.peers, self.node, cluster.ttl_s, cluster.rpc_timeout_s, self._before_serving,
                                                        epochs)
        self.state.follow(lambda: generations.serving)  # the core serves reads once this caught up (DESIGN §12.5)
        self.lookups = ShardedLookup(self.core.directory, self.node, self.peers, lambda: self.shard_map, cluster.rpc_timeout_s,
                                     cluster.ttl_s, newer=lambda ns, g: self._spawn(generations.enter(ns, g)))
        self.remote = RemoteTier(self.core, self.peers, self.lookups, cluster.data_plane, self.owner_of)
        self.publisher = Publisher(self.core.directory, self.node, self.peers, lambda: self.shard_map, cluster.rpc_timeout_s,
                                   is_member=lambda: self.is_member, tenant_of=lambda ns: self.owner_of(ns) or "",
                                   epoch=lambda: membership.epoch)
        self.replicas = Replicas(self.node, self.remote, self.peers, lambda: self._members, cluster.rpc_timeout_s)
        self.handoffs = HandoffPushes(self.node, self.remote, self.peers, cluster.rpc_timeout_s)  # prefill side (DESIGN §12.7)
        self.membership.on_members(self._on_members)
        self.membership.on_key("generations", self._heard_generation)
        self.membership.on_replaced(self._etcd_replaced)
        self.membership.on_state(self._on_state)
        self.membership.on_registering(self.incarnations.registering)
        await self.membership.start(timeout_s)
        async with asyncio.timeout(timeout_s):  # caught up with etcd's generations (a task _on_state started)
            while not self.serving:
                await asyncio.sleep(0.02)
        self.publisher.start()
        self.handoffs.start()
        logger.info("node %s joined cluster %s (epoch %d, data plane %s%s)", self.node, cluster.name, self.membership.epoch,
                    cluster.data_plane, f" on {data_address}" if data_address else "")

    def stop(self) -> None:
        """Leaves the cluster (the lease is revoked: the others drop this node's records at once) and stops the loop."""
        if not self._thread.is_alive():
            return
        self.state.leave()  # calls still arriving answer from this node alone
        try:
            self.call(self._stop(), 15)
        except (TimeoutError, KVStoreError) as exc:
            logger.warning("leaving the cluster did not finish: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    async def _stop(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
        if hasattr(self, "handoffs"):
            await self.handoffs.close()
        if self.membership is not None:
            await self.membership.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if hasattr(self, "remote"):  # its source checks, before the fetchers they use close
            await self.remote.close()
        if hasattr(self, "peers"):  # made by _start, which may have failed before (a data port in use)
            await self.peers.close()
        if self._page_server is not None:
            await self._page_server.close()
        if hasattr(self, "etcd"):
            await self.etcd.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float, to_end: bool = False) -> T:
        """Runs ``coro`` on the cluster loop from another thread; cancels it past ``timeout_s`` (``to_end``: returns
        once it ended, loop_calls.py)."""
        try:
            return run_on(self._loop, coro, timeout_s, to_end)
        except CancelledError:  # the loop's tasks are cancelled: the node is leaving
            raise TierUnavailable(f"node {self.node} is leaving the cluster: ask another node") from None

    def submit(self, coro: Coroutine[Any, Any, Any]) -> bool:
        """From another thread: ``coro`` becomes a task of the runtime (cancelled when the node leaves); False once the loop closed."""
        try:
            self._loop.call_soon_threadsafe(self._spawn, coro)
        except RuntimeError:
            coro.close()
            return False
        return True

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
        """Registered, its lease not lost (DESIGN §12: else split-brained), not leaving."""
        return self.membership is not None and self.membership.is_member and not self.state.leaving

    @property
    def serving(self) -> bool:
        """Whether this node may answer reads now: a member (not leaving) caught up with etcd's generations
        since it registered (cluster_generations.py). Otherwise every read is answered as for an empty
        namespace: nothing invalidated while it was away is served, no record it keeps is promised."""
        return self.state()

    def owner_lookup(self, namespace_id: bytes, keys: list[bytes]) -> list[LocationRun]:
        """What a node asking this one as a shard owner gets: every record here while serving, none otherwise."""
        return self.core.directory.lookup(namespace_id, keys) if self.serving else []

    def lookup(self, namespace_id: bytes, keys: list[bytes], time_remaining_s: float | None, tenant: str = "") -> list[LocationRun]:
        """The contiguous prefix of ``keys`` stored anywhere in the cluster, as runs; none while
        this node does not serve. ``tenant``: the caller's, named to the owners."""
        if not self.serving:
            return []
        timeout = self.cluster.rpc_timeout_s if time_remaining_s is None else max(0.01, time_remaining_s - _MARGIN_S)
        try:
            return self.call(self.lookups.lookup(namespace_id, keys, timeout, tenant), timeout + 1)
        except TimeoutError:
            return self.owner_lookup(namespace_id, keys)

    def fill(self, namespace_id: bytes, keys: list[bytes], time_remaining_s: float | None, tenant: str = "",
             landing: Landing | None = None) -> int:
        """Fetches the pages of ``keys`` held only elsewhere into the host tier (up to the first that cannot be had, or does
        not fit ``landing``: the tenant's quota), within the caller's deadline; then an acquire finds them. Returns how
        many pages this added to the leading ones held here (none while not a member)."""
        before = self.remote.local_prefix(namespace_id, keys)
        if not self.serving or before == len(keys):
            return 0
        timeout, wait = self._fetch_times(time_remaining_s)
        if timeout <= 0:
            return 0
        try:
            fetch = self.remote.read_into_landing(namespace_id, keys, timeout, tenant, landing)
            return max(0, self.call(fetch, wait, to_end=True) - before)
        except (TimeoutError, KVStoreError) as exc:
            logger.warning("remote fill of %d pages ended early: %r", len(keys), exc)
            return max(0, self.remote.local_prefix(namespace_id, keys) - before)

    def replicate(self, namespace_id: bytes, keys: list[bytes], replicas: int, time_remaining_s: float | None,
                  tenant: str = "") -> int:
        """Has other members copy the leading pages of ``keys`` held here until ``replicas``
        nodes hold them (replicas.py); returns how many leading pages that many nodes hold."""
        if not self.serving:
            return 0
        # the targets' own fetch deadline is this one less their margins (see _fetch_times)
        budget = self.cluster.fetch_timeout_s + _ABORT_S + 2 * _MARGIN_S
        if time_remaining_s is not None:
            budget = min(budget, time_remaining_s - _MARGIN_S)
        try:
            return self.call(self.replicas.replicate(namespace_id, keys, replicas, max(0.01, budget), tenant), budget + 1)
        except TimeoutError:
            return 0

    def copy_from(self, holder: str, namespace_id: bytes, keys: list[bytes], page_bytes: int, time_remaining_s: float | None,
                  tenant: str = "", landing: Landing | None = None, hashed: bool = True) -> int:
        """Fetches ``keys`` from ``holder`` (what fits ``landing``; ``hashed``: RemoteTier.fetch_from); the leading pages held here."""
        if not self.serving:
            return 0
        timeout, wait = self._fetch_times(time_remaining_s)
        if timeout <= 0:
            return self.remote.local_prefix(namespace_id, keys)
        try:
            # a handoff's push (unhashed): allocated and committed on this thread, caller_copy.py
            held = None if hashed else copy_on_caller(self, holder, namespace_id, keys, page_bytes, timeout, wait, landing)
            if held is None:
                held = self.call(self.remote.fetch_from(holder, namespace_id, keys, page_bytes, timeout, tenant, landing, hashed),
                                 wait, to_end=True)
            return held
        except (TimeoutError, KVStoreError) as exc:
            logger.warning("replica of %d pages from %s ended early: %r", len(keys), holder, exc)
            return self.remote.local_prefix(namespace_id, keys)

    def _fetch_times(self, time_remaining_s: float | None) -> tuple[float, float]:
        """(a fetch's own deadline, how long its caller waits for it): the caller's time less
        the answer's margin, of which the fetch's end keeps a share (``_ABORT_S``). A fetch not
        done by then is cancelled and waited for to its end: its landing stops making room."""
        timeout = self.cluster.fetch_timeout_s
        if time_remaining_s is None:
            return timeout, timeout + _ABORT_S
        wait = time_remaining_s - _MARGIN_S
        return min(timeout, wait - min(_ABORT_S, _ABORT_SHARE * wait)), min(wait, timeout + _ABORT_S)

    def prefetch(self, namespace_id: bytes, keys: list[bytes], tenant: str = "", landing: Landing | None = None) -> bool:
        """Starts fetching the pages of ``keys`` held only elsewhere (a hint: a queued request will need them) and returns
        at once; False when ``MAX_PREFETCHES`` are in flight already (the engine then recomputes or reads them on demand)."""
        if not self.serving:
            return False
        if self.remote.local_prefix(namespace_id, keys) == len(keys):
            return True
        with self._prefetch_lock:
            if self._prefetching >= MAX_PREFETCHES:
                return False
            self._prefetching += 1
        if not self.submit(self._prefetch(namespace_id, keys, tenant, landing)):  # cancelled if the node leaves
            with self._prefetch_lock:
                self._prefetching -= 1  # the slot is given back, not lost
            return False
        return True

    async def _prefetch(self, namespace_id: bytes, keys: list[bytes], tenant: str, landing: Landing | None) -> None:
        try:
            await self.remote.read_into_landing(namespace_id, keys, self.cluster.fetch_timeout_s, tenant, landing)
        except KVStoreError as exc:
            logger.info("prefetch of %d remote pages ended early: %r", len(keys), exc)
        finally:
            with self._prefetch_lock:
                self._prefetching -= 1

    def invalidate(self, namespace_id: bytes, time_remaining_s: float | None) -> tuple[int, int]:
        """Raises the namespace's generation in etcd and at every node (cluster_generations.py); returns
        (pages removed here, the new generation) once every node entered it or was fenced."""
        assert self.generations is not None
        if self.state.leaving:
            raise TierUnavailable(f"node {self.node} is leaving the cluster: invalidate namespace {namespace_id.hex()} "
                                  "at another node")
        timeout = max(0.01, (time_remaining_s or 3 * self.cluster.ttl_s) - _MARGIN_S)
        try:
            return self.call(self.generations.invalidate(namespace_id, timeout), timeout + 1)
        except TimeoutError:
            raise TierUnavailable(f"the invalidation of namespace {namespace_id.hex()} did not finish within the call's "
                                  "deadline; it may stand at some nodes: invalidate again") from None

    def _before_serving(self) -> None:
        """At every catch-up: the records the others gave this node before it registered (incarnations.py), the salts, the sessions."""
        cut = self.incarnations.own_past(self.membership.epoch) if self.membership is not None else None
        if cut is not None and (gone := self.core.directory.drop_others(cut)):
            logger.info("node %s registered again: %d records the others gave it before are dropped", self.node, gone)
        if self._reseed_salts is not None:
            self._reseed_salts()
        self.session_moves.reconcile()

    # -- membership listeners (on the loop) -------------------------------------------------
    def _on_members(self, members: Mapping[str, Member]) -> None:
        before, self.shard_map = self.shard_map, ShardMap(members, self.shard_config)
        # owners registered anew (a restart: their records are gone) under the same name: not a move of the shard map
        restarted = [n for n, m in members.items() if n != self.node and n in self._members and self._members[n].epoch != m.epoch]
        if self.generations is not None:  # a node that left may still serve for a TTL (cluster_generations.py)
            self.generations.left([self._members[n] for n in self._members if n not in members])
        self._members = dict(members)
        for peer in self.peers.update(members):
            self._spawn(peer.close())
        # nodes that left or registered again: the records a newer incarnation published (maybe before this was heard) stay
        for node, up_to_version in self.incarnations.watched({n: m.epoch for n, m in members.items() if n != self.node}):
            self._spawn(self._drop(node, up_to_version))
        if self.publisher is not None:
            self.publisher.members_changed(before, self.shard_map)
            self.publisher.republish_to(restarted)

    async def _drop(self, node: str, up_to_version: int) -> None:
        self.lookups.cache.forget_node(node)
        gone = await asyncio.to_thread(self.core.directory.drop_node, node, up_to_version)
        logger.info("node %s left the cluster (or re-registered): %d of its records dropped", node, gone)

    def _on_state(self, state: MemberState, epoch: int) -> None:
        if state is not MemberState.MEMBER or self.generations is None:
            return
        self._spawn(self.generations.keep_catching_up(epoch, 0.25))  # reads are served once it is done
        if epoch > 1 and self.publisher is not None and self.publisher.started:
            self.publisher.republish_all()  # the others dropped this node's records with its old epoch

    def _heard_generation(self, kv: KeyValue) -> None:
        if self.generations is not None and (task := self.generations.heard(kv)) is not None:
            self._tasks.add(task)
            task.add_done_callback(self._done)

    def _etcd_replaced(self) -> None:
        """etcd went back (wiped, restored): what it lost of generations and salts is written back."""
        if self.generations is not None and self.membership is not None:
            self.generations.etcd_replaced()
            self._spawn(self.generations.keep_catching_up(self.membership.epoch, 0.25))
