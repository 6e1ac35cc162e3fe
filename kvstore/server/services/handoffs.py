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

import grpc

from kvstore import validate
from kvstore._proto import handoff_pb2, handoff_pb2_grpc
from kvstore.config import ServerConfig
from kvstore.errors import InvalidRequest, LimitExceeded
from kvstore.security.interceptor import current_identity
from kvstore.server.handoff_markers import MAX_TTL_S
from kvstore.server.leases import HANDLE_BYTES
from kvstore.server.placement import Placement
from kvstore.server.services.rpc_errors import unary
from kvstore.server.services.streams import StreamGate
from kvstore.server.tenancy.gate import Gate
from kvstore.server.tenancy.gate_handoffs import DEFAULT_TTL_MS
from kvstore.server.tenancy.node_calls import MAX_NODE_ID, require_node

HANDOFF_ID_BYTES = 16


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
    """Each handler validates its request, makes one call of the tenancy gate (tenancy/gate.py
    and gate_handoffs.py) and answers; exceptions become statuses in rpc_errors.py."""

    def __init__(self, core: Placement, config: ServerConfig, gate: Gate, streams: StreamGate) -> None:
        self.core = core
        self.gate = gate
        self.streams = streams  # a Wait holds a stream slot
        self._waiting: Counter[str] = Counter()  # waits in progress per tenant
        self._waiting_lock = threading.Lock()
        self.config = config
        self.metrics = core.metrics

    def _keys(self, values: list[bytes], allow_empty: bool = False) -> list[bytes]:
        return validate.keys(values, self.config.max_pages_per_request, allow_empty)

    @unary
    def Open(self, request: handoff_pb2.OpenHandoffRequest, context: grpc.ServicerContext) -> handoff_pb2.OpenHandoffResponse:
        ns = validate.namespace_id(request.namespace_id)
        ident = handoff_id(request.handoff_id)
        to_node = node_id(request.to_node, "to_node")
        ttl = ttl_ms(request.ttl_ms)
        keys = self._keys(list(request.keys), allow_empty=True)
        self.gate.open_handoff(current_identity(), ns, ident, to_node, ttl, keys)
        return handoff_pb2.OpenHandoffResponse()

    @unary
    def Complete(self, request: handoff_pb2.CompleteHandoffRequest,
                 context: grpc.ServicerContext) -> handoff_pb2.CompleteHandoffResponse:
        ns = validate.namespace_id(request.namespace_id)
        ident = handoff_id(request.handoff_id)
        keys = self._keys(list(request.keys), allow_empty=True)  # none: nothing handed off (HandoffGate.complete)
        to_node = node_id(request.to_node, "to_node")
        return handoff_pb2.CompleteHandoffResponse(num_pages=self.gate.complete(current_identity(), ns, ident, keys, to_node, context))

    @unary
    def Wait(self, request: handoff_pb2.WaitHandoffRequest, context: grpc.ServicerContext) -> handoff_pb2.WaitHandoffResponse:
        ns = validate.namespace_id(request.namespace_id)
        ident = handoff_id(request.handoff_id)
        keys = self._keys(list(request.keys))
        if not 0 < request.deadline_ms <= MAX_TTL_S * 1000:
            raise InvalidRequest(f"deadline_ms must be 1..{int(MAX_TTL_S * 1000)}, got {request.deadline_ms}")
        who = current_identity()
        n, generation = self.gate.wait(who, ns, ident, keys, request.deadline_ms, context,
                                       lambda: self._waiting_slot(who.tenant, context))
        return handoff_pb2.WaitHandoffResponse(num_pages=n, generation=generation)

    @contextmanager
    def _waiting_slot(self, tenant: str, context: grpc.ServicerContext) -> Iterator[None]:
        """A stream slot for the wait (busy: the idle watchdog leaves it to its own deadline), within the tenant's half."""
        with self._waiting_lock:
            if self._waiting[tenant] >= max(1, self.streams.max_streams // 2):
                raise LimitExceeded(f"tenant {tenant!r} has {self._waiting[tenant]} handoff waits in progress at node "
                                    f"{self.core.node}; retry later")
            slot = self.streams.open("Handoff.Wait", context)
            self._waiting[tenant] += 1
        slot.touch(busy=True)
        try:
            yield
        finally:
            self.streams.close(slot)
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
        starts before the first page lands does not pull the same pages through the pool. With
        ``complete`` and no keys, nothing is handed off: the marker goes, with its pins."""
        require_node(current_identity(), "Handoff.Push")
        ns = validate.namespace_id(request.namespace_id)
        ident = handoff_id(request.handoff_id)
        keys = self._keys(list(request.keys), allow_empty=True)
        holder = node_id(request.holder, "holder")
        ttl = ttl_ms(request.ttl_ms)
        n = self.gate.push(current_identity(), ns, ident, keys, holder, ttl, request.tenant, request.page_bytes, request.complete,
                           context)
        return handoff_pb2.PushHandoffResponse(num_pages=n)

    @unary
    def PushLayers(self, request: handoff_pb2.PushLayersRequest, context: grpc.ServicerContext) -> handoff_pb2.PushLayersResponse:
        """The prefill node ``holder`` sends a range of pages it has not stored yet (whole layers, as
        a layer-wise save wrote them): landed here in slots held for the handoff, committed by the
        Push that names the pages once stored (DESIGN §12.7, layer-wise pushes)."""
        require_node(current_identity(), "Handoff.PushLayers")
        ns = validate.namespace_id(request.namespace_id)
        ident = handoff_id(request.handoff_id)
        keys = self._keys(list(request.keys))
        holder = node_id(request.holder, "holder")
        layout = validate.layout(request.layout)
        offset, length = request.offset, request.length
        if not 0 < length <= layout.page_bytes - offset:
            raise InvalidRequest(f"a range of {length} bytes at {offset} of pages of {layout.page_bytes} bytes")
        if len(request.allocation) != HANDLE_BYTES or request.allocation == bytes(HANDLE_BYTES):
            raise InvalidRequest(f"allocation must be the holder's allocation handle ({HANDLE_BYTES} bytes)")
        n = self.gate.push_layers(current_identity(), ns, ident, holder, request.tenant, layout, keys, offset, length,
                                  bytes(request.allocation), ttl_ms(request.ttl_ms), context)
        return handoff_pb2.PushLayersResponse(num_pages=n)
