"""The Handoff servicer (prefill -> decode, DESIGN §12.7): thin adapters over the decode
node's completion markers (server/handoff_markers.py) and the prefill node's pushes
(server/cluster/handoff_push.py). Each handler validates everything before it changes anything.

A Wait holds its thread until its deadline, as a stream does: it takes a slot of the StreamGate
(so unary calls keep their ``workers`` threads however many decode requests wait), and a tenant
holds at most half of them (RESOURCE_EXHAUSTED beyond, for that caller only).

More: kvstore/server/services/README.md (### handoffs.py).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import grpc

from kvstore import validate
from kvstore._proto import handoff_pb2, handoff_pb2_grpc
from kvstore.config import ServerConfig
from kvstore.errors import InvalidRequest, LimitExceeded, PermissionDenied, TierUnavailable
from kvstore.security.identity import Identity, Rights
from kvstore.security.interceptor import current_identity
from kvstore.server.handoff_markers import MAX_TTL_S, HandoffMarkers
from kvstore.server.placement import Placement
from kvstore.server.services.rpc_errors import unary
from kvstore.server.services.streams import StreamGate
from kvstore.server.tenancy import Tenancy
from kvstore.server.tenancy.cluster_reads import ClusterReads
from kvstore.server.tenancy.node_calls import MAX_NODE_ID, acting_for, on_behalf, require_node
from kvstore.server.tenancy.quotas import NOTHING, Reservation
from kvstore.server.tenancy.room import room

if TYPE_CHECKING:
    from kvstore.server.cluster import ClusterRuntime

HANDOFF_ID_BYTES = 16
DEFAULT_TTL_MS = 30_000
_MARGIN_S = 0.25  # of a caller's deadline, kept for the answer to reach it


def handoff_id(value: bytes) -> bytes:
    if len(value) != HANDOFF_ID_BYTES:
        raise InvalidRequest(f"handoff_id must be {HANDOFF_ID_BYTES} bytes (new_handoff_id()), got {len(value)}")
    return bytes(value)


def node_id(value: str, name: str) -> str:
    if len(value) > MAX_NODE_ID:
        raise InvalidRequest(f"{name} must be a node id of at most {MAX_NODE_ID} characters, got {len(value)}")
    return value


def ttl_ms(value: int) -> int:
    if value > MAX_TTL_S * 1000:
        raise InvalidRequest(f"ttl_ms must be at most {int(MAX_TTL_S * 1000)}, got {value}")
    return value or DEFAULT_TTL_MS


class HandoffService(handoff_pb2_grpc.HandoffServicer):
    def __init__(self, core: Placement, config: ServerConfig, tenancy: Tenancy, markers: HandoffMarkers, gate: StreamGate,
                 cluster: ClusterRuntime | None = None) -> None:
        self.core = core
        self.gate = gate
        self._waiting: Counter[str] = Counter()  # waits in progress per tenant
        self._waiting_lock = threading.Lock()
        self.config = config
        self.tenancy = tenancy
        self.markers = markers
        self.cluster = cluster
        self.cluster_reads = ClusterReads(tenancy, cluster) if cluster is not None else None
        self.metrics = core.metrics

    def _keys(self, values: list[bytes], allow_empty: bool = False) -> list[bytes]:
        return validate.keys(values, self.config.max_pages_per_request, allow_empty)

    def _pushes_to(self, to_node: str) -> bool:
        """Whether pages go to another node (else: the pool, or this node is the decode node)."""
        return self.cluster is not None and bool(to_node) and to_node != self.core.node

    @staticmethod
    def _writer(who: Identity) -> None:
        if not who.allows(Rights.WRITE):
            raise PermissionDenied(f"tenant {who.tenant!r} lacks the write right (a handoff hands off pages it stored)")

    @unary
    def Open(self, request: handoff_pb2.OpenHandoffRequest, context: grpc.ServicerContext) -> handoff_pb2.OpenHandoffResponse:
        ns = validate.namespace_id(request.namespace_id)
        ident = handoff_id(request.handoff_id)
        to_node = node_id(request.to_node, "to_node")
        ttl = ttl_ms(request.ttl_ms)
        keys = self._keys(list(request.keys), allow_empty=True)
        who = current_identity()
        self._writer(who)
        if self._pushes_to(to_node):
            assert self.cluster is not None
            self.cluster.call(self.cluster.handoffs.open(on_behalf(who), ns, ident, to_node, ttl, keys,
                                                         lambda: self.tenancy.sees(who, ns)), self.cluster.cluster.rpc_timeout_s)
        return handoff_pb2.OpenHandoffResponse()

    @unary
    def Complete(self, request: handoff_pb2.CompleteHandoffRequest,
                 context: grpc.ServicerContext) -> handoff_pb2.CompleteHandoffResponse:
        ns = validate.namespace_id(request.namespace_id)
        ident = handoff_id(request.handoff_id)
        keys = self._keys(list(request.keys))
        to_node = node_id(request.to_node, "to_node")
        who = current_identity()
        self._writer(who)
        readable = self.tenancy.may_read(who, ns)
        if self.cluster is not None and to_node != self.core.node:
            left = context.time_remaining()
            timeout = max(0.01, (left if left is not None else 30.0) - _MARGIN_S)
            try:
                n = self.cluster.call(self.cluster.handoffs.complete(on_behalf(who), ns, ident, keys if readable else [],
                                                                     to_node, timeout), timeout + 1)
            except TimeoutError:
                raise TierUnavailable(f"handoff not completed within {timeout:.1f} s; the pages stay here") from None
            return handoff_pb2.CompleteHandoffResponse(num_pages=n)
        # no cluster, or this node is the decode node: the marker is here
        held = self.markers.held(ns, keys) if readable else 0
        if held:
            marker = self.markers.open(who.tenant, ns, ident, DEFAULT_TTL_MS)
            self.markers.arrived(marker, keys[:held], pushed=True, complete=keys[:held])
        return handoff_pb2.CompleteHandoffResponse(num_pages=held)

    @unary
    def Wait(self, request: handoff_pb2.WaitHandoffRequest, context: grpc.ServicerContext) -> handoff_pb2.WaitHandoffResponse:
        ns = validate.namespace_id(request.namespace_id)
        ident = handoff_id(request.handoff_id)
        keys = self._keys(list(request.keys))
        if not 0 < request.deadline_ms <= MAX_TTL_S * 1000:
            raise InvalidRequest(f"deadline_ms must be 1..{int(MAX_TTL_S * 1000)}, got {request.deadline_ms}")
        who = current_identity()
        self.tenancy.may_read(who, ns)  # PermissionDenied without the read right
        left = context.time_remaining()
        deadline = min(request.deadline_ms / 1000, (left if left is not None else MAX_TTL_S) - _MARGIN_S)
        with self._waiting_slot(who.tenant, context):
            reads = self.cluster_reads
            # the wait's deadline kept the answer's margin already: ClusterRuntime.fill keeps its own
            pull = (lambda time_left: reads.fill(who, ns, keys, time_left + _MARGIN_S)) if reads is not None else None
            context.add_callback(self.markers.wake)  # a cancelled wait ends now, its stream slot given back
            # opened as its reader (nothing drops it before the wait reads it); the wait, called next, counts it off
            marker = self.markers.open(who.tenant, ns, ident, max(DEFAULT_TTL_MS, request.deadline_ms), waiter=True)
            n = self.markers.wait(marker, keys, max(0.0, deadline), pull, sees=lambda: self.tenancy.may_read(who, ns),
                                  alive=context.is_active, registered=True)
        return handoff_pb2.WaitHandoffResponse(num_pages=n, generation=marker.generation)

    @contextmanager
    def _waiting_slot(self, tenant: str, context: grpc.ServicerContext) -> Iterator[None]:
        """A stream slot for the wait (busy: the idle watchdog leaves it to its own deadline), within the tenant's half."""
        with self._waiting_lock:
            if self._waiting[tenant] >= max(1, self.gate.max_streams // 2):
                raise LimitExceeded(f"tenant {tenant!r} has {self._waiting[tenant]} handoff waits in progress at node "
                                    f"{self.core.node}; retry later")
            slot = self.gate.open("Handoff.Wait", context)
            self._waiting[tenant] += 1
        slot.touch(busy=True)
        try:
            yield
        finally:
            self.gate.close(slot)
            with self._waiting_lock:
                self._waiting[tenant] -= 1
                if not self._waiting[tenant]:
                    del self._waiting[tenant]

    @unary
    def Push(self, request: handoff_pb2.PushHandoffRequest, context: grpc.ServicerContext) -> handoff_pb2.PushHandoffResponse:
        """The prefill node ``holder`` hands pages over: fetched from it (as a replica is), kept
        for the handoff's marker; with ``complete``, what the holder could not give is pulled
        through the pool, then the marker completes once every page is here. Without keys (the
        prefill node's announce at Open): the marker is made, marked pushed, so that a wait that
        starts before the first page lands does not pull the same pages through the pool."""
        require_node(current_identity(), "Handoff.Push")
        ns = validate.namespace_id(request.namespace_id)
        ident = handoff_id(request.handoff_id)
        keys = self._keys(list(request.keys), allow_empty=not request.complete)
        holder = node_id(request.holder, "holder")
        ttl = ttl_ms(request.ttl_ms)
        if self.cluster is None or not holder or (keys and request.page_bytes <= 0):
            raise InvalidRequest("Handoff.Push needs cluster mode, a holder and page_bytes")
        who = acting_for(current_identity(), request.tenant)
        claimed = self.tenancy.claim(who, ns)
        held = 0
        try:
            marker = self.markers.open(who.tenant, ns, ident, ttl)
            if not keys:
                self.markers.arrived(marker, [], pushed=True)
                return handoff_pb2.PushHandoffResponse(num_pages=0)
            have = self.markers.held(ns, keys)
            fits, reserved = self._room(who, len(keys) - have, request.page_bytes, context)
            try:
                want = keys[: have + fits]
                held = self.cluster.copy_from(holder, ns, want, request.page_bytes, context.time_remaining(), on_behalf(who))
                if request.complete and held < len(want):  # what the holder could not give: through the pool
                    self.cluster.fill(ns, want, context.time_remaining(), on_behalf(who))
                    held = self.markers.held(ns, want)
            finally:
                reserved.release()  # the pages that landed count as the tenant's host bytes now
            self.markers.arrived(marker, keys, pushed=True, complete=keys if request.complete else None)
        finally:
            if claimed:
                self.tenancy.settle(who, ns, held > 0)
        return handoff_pb2.PushHandoffResponse(num_pages=held)

    def _room(self, who: Identity, lacking: int, page_bytes: int, context: grpc.ServicerContext) -> tuple[int, Reservation]:
        """How many of the ``lacking`` pages fit in the tenant's host quota here (its own coldest
        pages written down to make room, as for a put), reserved while they land; halved until
        they fit, else none. A handoff's bytes count as any page of the tenant's."""
        while lacking > 0:
            try:
                return lacking, room(self.tenancy.quotas, self.core, who, lacking, page_bytes, context)
            except LimitExceeded:
                lacking //= 2
        return 0, NOTHING
