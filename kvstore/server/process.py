"""The kvstore server: placement core + Directory and Data services + /metrics."""

from __future__ import annotations

import logging
import secrets
import shutil
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

import grpc

from kvstore import pagecopy
from kvstore._proto import (
    data_pb2,
    directory_pb2,
    directory_pb2_grpc,
    handoff_pb2,
    handoff_pb2_grpc,
    migration_pb2,
    migration_pb2_grpc,
)
from kvstore.callsocket.frames import CALL_TOKEN_BYTES
from kvstore.callsocket.socket_server import CallSocket, TenantConnections
from kvstore.config import ServerConfig
from kvstore.device_ops import PoolHandout
from kvstore.errors import ConfigError
from kvstore.page_wire.grpc_chunks import MESSAGE_OPTIONS
from kvstore.security.arena_socket import ArenaSocket
from kvstore.security.identity import Identity
from kvstore.security.salts import TenantSalts
from kvstore.security.server_security import ServerSecurity
from kvstore.server.dirlock import DirectoryLock
from kvstore.server.handoff_markers import HandoffMarkers
from kvstore.server.leases import LeaseTable
from kvstore.server.metrics import Metrics, serve_metrics
from kvstore.server.placement import Demoter, Placement
from kvstore.server.placement.assembly import Wrap, open_directory
from kvstore.server.rpc_pool import RetiringPool
from kvstore.server.services.data import DataService
from kvstore.server.services.directory import DirectoryService
from kvstore.server.services.handlers import add_service, data_handlers, generated_handlers
from kvstore.server.services.handoffs import HandoffService
from kvstore.server.services.migration import MigrationService
from kvstore.server.services.sizes import receive_limit, request_limits
from kvstore.server.services.streams import StreamGate
from kvstore.server.serving import ServingState
from kvstore.server.session_expiry import SessionExpiry
from kvstore.server.session_owners import SessionOwners
from kvstore.server.socket_dir import arena_socket_path
from kvstore.server.tenancy import NamespaceOwners, Quotas, Tenancy
from kvstore.server.tenancy.gate import Gate
from kvstore.server.tenancy.owners import OWNER_WORDS, owner_for, tenant_for
from kvstore.server.tenancy.ssd_share import SsdShares
from kvstore.server.tokenlog import TokenLog

if TYPE_CHECKING:  # cluster mode is imported only when the server runs it
    from kvstore.server.cluster import ClusterRuntime
    from kvstore.server.cluster.migrations import SessionMoves

logger = logging.getLogger(__name__)

MIN_CLIENT_PING_INTERVAL_MS = 10_000  # a client may ping this often (keepalive_time_ms >= 10 s); more is a ping flood


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Message sizes, and keepalive: the server pings every connection each keepalive_s and
    closes one whose ping goes unanswered for keepalive_timeout_s, which cancels its streams
    (a peer that froze or vanished without a FIN otherwise holds its threads for good)."""
    return [
        ("grpc.max_receive_message_length", receive_limit(config)),
        *[(name, value) for name, value in MESSAGE_OPTIONS if name != "grpc.max_receive_message_length"],
        ("grpc.keepalive_time_ms", int(config.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.http2.ping_timeout_ms", int(config.keepalive_timeout_s * 1000)),  # grpcio 1.85 waits this long, not the above
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging a connection whose streams are quiet
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 2),
    ]


def _cluster_salts(config: ServerConfig) -> Callable[[], TenantSalts]:
    """The tenants' salts of a cluster node: kept in etcd, so that every node folds the same salt
    into a tenant's namespace ids (kvstore/cluster/salt_records.py; imported only in cluster mode)."""
    assert config.cluster is not None
    cluster = config.cluster

    def make() -> TenantSalts:
        from kvstore.cluster.etcd import parse_endpoints
        from kvstore.cluster.salt_records import EtcdSalts

        return EtcdSalts(config.data_dir, parse_endpoints(cluster.etcd), cluster.name)

    return make


def split_host_port(text: str, flag: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{flag} must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


class Server:
    """Owns the gRPC server, the placement core (``core``), its demoter and scrubber, and
    the metrics endpoint.

    ``start()`` binds (port 0 picks a free one; see ``port``); ``stop()`` stops taking RPCs,
    lets running ones finish within ``grace_s``, then closes the tiers (the arena file is
    unlinked; ssd pages and the directory stay on disk). ``wrap`` goes around every tier
    (tests: a ``FaultyTier``).
    """

    def __init__(self, config: ServerConfig, wrap: Wrap | None = None) -> None:
        if "hbm" in config.tiers:  # first: without a usable device nothing is created
            from kvstore.tiers.hbm import check_device

            check_device(config.hbm)
        self.config = config
        # First: a directory a live server uses is refused before anything is created or opened.
        self._dirs = DirectoryLock([(config.data_dir, "--data-dir"),
                                    *([(config.ssd.directory, "--ssd-dir")] if config.ssd and "ssd" in config.tiers else [])])
        try:
            self._build(config, wrap)
        except BaseException:
            self._dirs.release()
            raise

    def _build(self, config: ServerConfig, wrap: Wrap | None) -> None:
        """Builds in one direction (DESIGN §2 "How the server is put together"): each part gets
        what it needs, made before it, in its constructor; nothing is assigned to a part later."""
        self.metrics = metrics = Metrics()
        self._socket_dirs: list[Path] = []  # the sockets' own directories (a long --data-dir), removed by a failed build
        # Security hook (DESIGN §11), built first: a bad auth file or certificate leaves no arena
        # behind. Every call is authenticated before its handler runs; handlers read the caller
        # with kvstore.security.interceptor.current_identity().
        self.security = ServerSecurity(config.security, config.data_dir,
                                       lambda method, code: metrics.rpc_errors.labels(method, code).inc(),
                                       salts=_cluster_salts(config) if config.cluster is not None else None)
        # What is opened is closed again, last first, when a later part fails (a failed start leaves nothing open).
        undo: list[Callable[[], object]] = [self.security.salts.close] if self.security.salts is not None else []
        try:
            self._build_core(config, wrap, undo)
        except BaseException:
            for close in reversed(undo):
                try:
                    close()
                except Exception:  # the build's error is the one to report
                    logger.exception("closing what the failed build had opened")
            raise

    def _build_core(self, config: ServerConfig, wrap: Wrap | None, undo: list[Callable[[], object]]) -> None:
        """The stores, the tenancy and the placement core, then what is built on them; each
        thing opened is added to ``undo``."""
        metrics, authenticator = self.metrics, self.security.authenticator
        # The stores the tenancy counts from: the directory (its records loaded), the lease table, the token log.
        directory = open_directory(config)
        undo.append(directory.close)
        leases = LeaseTable(config.default_lease_ms, config.max_lease_ms, config.allocation_ttl_ms)
        self.wal = TokenLog(config.data_dir, config.token_log_map_bytes)
        undo.append(self.wal.close)
        # Who owns each namespace, and what each tenant may hold (DESIGN §11). The call socket's connections per
        # tenant are counted by the call socket (made last) and read by the quotas.
        owners = NamespaceOwners(directory.env)
        connections = TenantConnections()
        quotas = Quotas(config.tenant_quota, lambda: authenticator.quotas, owners, directory, leases, self.wal,
                        config.host.hint_grace_s, metrics, call_connections=connections.held)
        self.tenancy = Tenancy(owners, quotas)
        # In cluster mode a node serves reads only as a member caught up with etcd's generations (DESIGN §12.5): the
        # core and the session owners read this state, the cluster runtime (made after the core) drives it.
        serving = ServingState() if config.cluster is not None else None
        # With tenants, each has its own arena (tiers/arenas.py), keyed by its owner (tenancy/owners.py), sized by its host_bytes quota,
        # holding the pages of the namespaces it owns; it is handed over by the arena socket.
        # Tenants' ssd shares hold wherever pages reach the ssd tier (durable writes and demotion).
        self.core = core = Placement(config, metrics, wrap=wrap, owner_of=owners.core_owner,
                                     arena_bytes=lambda owner: quotas.limits(tenant_for(owner)).host_bytes, serving=serving,
                                     directory=directory, leases=leases, shares=partial(SsdShares, quotas), words=OWNER_WORDS)
        undo[undo.index(directory.close)] = core.close  # the core closes the directory with its tiers (its arena: RAM in /dev/shm)
        undo.append(lambda: [shutil.rmtree(d, ignore_errors=True) for d in self._socket_dirs])
        self._build_around(config, core, serving, owners, quotas, connections)

    def _socket_path(self, name: str) -> Path:
        """``arena_socket_path``; a directory made for it is noted for a failed build to remove."""
        path = arena_socket_path(self.config.data_dir, name)
        if path.parent != self.config.data_dir:
            self._socket_dirs.append(path.parent)
        return path

    def _build_around(self, config: ServerConfig, core: Placement, serving: ServingState | None, owners: NamespaceOwners,
                      quotas: Quotas, connections: TenantConnections) -> None:
        """What is built on the core: the demoter, the cluster runtime, the services and sockets."""
        metrics, authenticator = self.metrics, self.security.authenticator
        self.demoter = Demoter(core)
        # Live migration (DESIGN §12.8): who owns each migrated session here; cluster mode writes none before it caught up.
        self.session_owners = SessionOwners(self.wal, config.node, lambda call: metrics.session_refusals.labels(call).inc(),
                                            serving=serving)
        self.cluster: ClusterRuntime | None = None  # cluster mode (--cluster): joins in start(), leaves first in stop()
        if serving is not None:  # cluster mode
            from kvstore.server.cluster import ClusterRuntime

            # what this node publishes names the namespace's tenant; at every catch-up (before_serving) the others' old
            # records go, the salts are reseeded, then sessions
            self.cluster = ClusterRuntime(core, config, serving, owners.owner, self.session_owners, self.wal,
                                          reseed_salts=getattr(self.security.salts, "reseed", None))
        self.session_moves: SessionMoves | None = self.cluster.session_moves if self.cluster is not None else None
        # sessions idle past --session-idle-s end; not one a migration still needs (undecided, or fenced here and not adopted)
        self.session_expiry = SessionExpiry(self.wal, config.session_idle_s, metrics, keep=self.session_owners.kept,
                                            refresh=self.session_moves.release_adopted if self.session_moves else None)
        # Open streams hold at most max_streams threads; unary calls always have the other workers.
        self.streams = StreamGate(config.max_streams, config.stream_idle_s)
        pool = RetiringPool(config.workers + config.max_streams)  # idle threads end: a burst's do not stay (rpc_pool.py)
        self._grpc = grpc.server(pool, options=grpc_options(config), interceptors=[self.security.interceptor])
        # Handoffs (DESIGN §12.7): completion markers held here as a decode node; Acquire lets go of what a waiter took over.
        self.handoffs = HandoffMarkers(self.core)
        # The arena socket hands each tenant its arena (tenant arenas) and, with hbm, its device pool.
        self._tenant_arenas = bool(config.security.tenants) and not config.security.share_arena  # an arena per tenant
        hbm = "hbm" in config.tiers
        self.arena_socket: ArenaSocket | None = None
        if self._tenant_arenas or hbm:
            self.arena_socket = ArenaSocket(self._socket_path("arena.sock"), authenticator, self._arena_for,
                                            pool_for=self._pool_for if hbm else None)
        socket_path = self.arena_socket.path if self.arena_socket else None
        # The tenancy gate in front of the core (DESIGN §11): each call's caller resolved, quota reserved, core called,
        # settled; GetInfo, Allocate and Acquire name the caller's own arena and pool (tenancy/gate_arenas.py).
        gate = Gate(self.core, self.tenancy, self.session_owners, self.handoffs, self.cluster,
                    wal=self.wal, moves=self.session_moves, share_arena=config.security.share_arena,
                    arena_socket=socket_path if self._tenant_arenas else None, pool_socket=socket_path if hbm else None)
        directory_service = DirectoryService(self.core, config, gate)
        directory_handlers = generated_handlers(directory_pb2_grpc.add_DirectoryServicer_to_server, directory_service)
        guarded = add_service(self._grpc, directory_pb2.DESCRIPTOR.services_by_name["Directory"], directory_handlers, self.streams,
                              self.metrics, request_limits(config))
        # The same-host call socket's path and token, made before the services that announce them (GetInfo).
        call_path, call_token = self._socket_path("call.sock"), secrets.token_bytes(CALL_TOKEN_BYTES)
        data_service = DataService(self.core, config, gate, call_path, call_token)
        guarded |= add_service(self._grpc, data_pb2.DESCRIPTOR.services_by_name["Data"], data_handlers(data_service),
                               self.streams, self.metrics, request_limits(config))
        migration = MigrationService(self.core, config, gate)
        guarded |= add_service(self._grpc, migration_pb2.DESCRIPTOR.services_by_name["Migration"],
                               generated_handlers(migration_pb2_grpc.add_MigrationServicer_to_server, migration),
                               self.streams, self.metrics, request_limits(config))
        handoffs = HandoffService(self.core, config, gate, self.streams)
        guarded |= add_service(self._grpc, handoff_pb2.DESCRIPTOR.services_by_name["Handoff"],
                               generated_handlers(handoff_pb2_grpc.add_HandoffServicer_to_server, handoffs),
                               self.streams, self.metrics, request_limits(config))
        # Same-host unary calls without gRPC (DESIGN §11 "Same-host paths"), answered by the same guarded handlers.
        self.call_socket = CallSocket(
            call_path, authenticator, guarded, call_token,
            undo={"Acquire": lambda answer, who: gate.release(who, answer.lease_id),
                  "Allocate": lambda answer, who: gate.abort(who, answer.allocation_id)},
            rejected=lambda method, code: metrics.rpc_errors.labels(method, code).inc(),
            tenant_limit=quotas.call_connection_limit, quota_refused=lambda tenant: quotas.refused(tenant, "call_connections"),
            connections=connections)
        self._data = data_service
        self.port = 0
        self.metrics_port = 0
        self._metrics_http: WSGIServer | None = None
        self._stopped = threading.Event()
        self._scrubber: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, _ = split_host_port(self.config.listen, "--listen")
        return f"{host}:{self.port}"

    def _arena_for(self, identity: Identity) -> tuple[int, int] | None:
        """The arena socket's answer: the descriptor and size of the caller's tenant's arena
        (None without tenant arenas: the one arena is announced by path)."""
        if identity.via == "local" or not self._tenant_arenas:
            return None
        arena = self.core.arena_of(owner_for(identity.tenant))
        return arena.fd, arena.size_bytes

    def _pool_for(self, identity: Identity) -> PoolHandout | None:
        """The arena socket's answer to an engine: its tenant's hbm pool (tiers/pools.py)."""
        return self.core.pool_of(owner_for(identity.tenant))

    def start(self) -> None:
        """Starts serving; on any failure stops what was made and started (arena, sockets, threads,
        the data directory's lock) before it raises, so the process may start another server."""
        try:
            self._start()
        except BaseException:
            try:
                self.stop(grace_s=0)
            except Exception:  # the start's error is the one to report
                logger.exception("stopping what the failed start had built")
            raise

    def _start(self) -> None:
        try:
            self.port = self.security.add_port(self._grpc, self.config.listen)  # TLS when --tls-cert is given
        except RuntimeError as exc:  # grpc raises where older releases answered port 0
            raise ConfigError(f"--listen {self.config.listen}: cannot bind (address in use?): {exc}") from None
        if self.port == 0:
            raise ConfigError(f"--listen {self.config.listen}: cannot bind (address in use?)")
        if self.config.security.local_socket is not None:
            self.security.add_local(self._grpc, self.config.security.local_socket)
        if self.config.metrics_listen:  # bound before anything starts: a port in use stops nothing half-started
            host, port = split_host_port(self.config.metrics_listen, "--metrics-listen")
            try:
                self._metrics_http = serve_metrics(host, port, self.metrics.registry)
            except OSError as exc:
                raise ConfigError(f"--metrics-listen {self.config.metrics_listen}: cannot bind ({exc.strerror}); "
                                  "another server on this host? give it another --metrics-listen, or 'off'") from exc
            self.metrics_port = self._metrics_http.server_port
        if self.arena_socket is not None:
            self.arena_socket.start()  # before the first GetInfo announces it
        self.call_socket.start()  # likewise
        self._grpc.start()
        if self.cluster is not None:
            self.cluster.start()  # after the gRPC server: peers may call as soon as this node is a member
        self.streams.start()
        self.handoffs.start()
        self.demoter.start()
        self.session_expiry.start()
        if self.config.scrub_pages_per_s > 0 and len(self.core.tiers) > 1:
            self._scrubber = threading.Thread(target=self._scrub, name="scrub", daemon=True)
            self._scrubber.start()
        logger.info(
            "kvstore-server listening on %s%s (%s; tiers %s, %s, page copies %s)",
            self.address, f" and unix:{self.config.security.local_socket}" if self.config.security.local_socket else "",
            self.security.describe(), ",".join(self.config.tiers),
            f"metrics on {self.config.metrics_listen.rsplit(':', 1)[0]}:{self.metrics_port}"
            if self._metrics_http else "metrics off",
            "native" if pagecopy.NATIVE else f"in numpy, ~1.4x slower: {pagecopy.NATIVE_MISSING}",
        )

    def reload_security(self) -> bool:
        """Re-reads --auth-file (SIGHUP); a file that does not load keeps the current one."""
        return self.security.reload()

    def _scrub(self) -> None:
        """Verifies SSD pages at a bounded rate so that damage is found before a reader
        needs the page."""
        interval = 1.0 / self.config.scrub_pages_per_s
        while not self._stopped.wait(interval):
            try:
                if self.core.scrub_one() is None:
                    self._stopped.wait(1.0)
            except Exception:  # the scrub must outlive one bad round
                logger.exception("scrub round failed")

    def stop(self, grace_s: float = 5.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.call_socket.stop()  # first, as gRPC stops taking calls first: nothing is served while the rest stops
        self.core.directory.events.close()  # wakes its followers: the cluster's publisher thread ends now,
        # not at its next 0.5 s poll (its close joins it: a node's stop took ~1 s)
        if self.cluster is not None:
            self.cluster.stop()
        if self._scrubber is not None:
            self._scrubber.join(5)
        self._grpc.stop(grace_s).wait()
        if self.security.salts is not None:
            self.security.salts.close()
        local = self.config.security.local_socket
        if local is not None and local.is_socket():
            local.unlink(missing_ok=True)
        if self.call_socket.path.parent != self.config.data_dir:
            shutil.rmtree(self.call_socket.path.parent, ignore_errors=True)
        if self.arena_socket is not None:
            self.arena_socket.stop()  # no new hand-overs; clients keep the mappings they have until they close
            if self.arena_socket.path.parent != self.config.data_dir:
                shutil.rmtree(self.arena_socket.path.parent, ignore_errors=True)
        self._data.close()
        self.handoffs.close()
        self.streams.stop()
        self.demoter.stop()
        self.session_expiry.stop()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        self.core.close()
        self.wal.close()
        self._dirs.release()
        logger.info("kvstore-server stopped")

    def wait(self) -> None:
        self._grpc.wait_for_termination()
