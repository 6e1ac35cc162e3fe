"""The Directory servicer: a thin adapter from gRPC messages to the directory and the placement core."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from kvstore import validate
from kvstore._proto import common_pb2, directory_pb2, directory_pb2_grpc
from kvstore.config import ServerConfig
from kvstore.directory import Event
from kvstore.errors import InvalidRequest, LimitExceeded
from kvstore.security.interceptor import current_identity
from kvstore.server.placement import Placement
from kvstore.server.services.rpc_errors import stream, unary
from kvstore.server.stats import CoreStats
from kvstore.server.tenancy.gate import Gate
from kvstore.server.tenancy.gate_directory import Record
from kvstore.types import TIER_NAMES, Location

MAX_NODE_NAME = 255


def location_msg(loc: Location | None) -> common_pb2.Location | None:
    if loc is None:
        return None
    return common_pb2.Location(node=loc.node, tier=loc.tier, version=loc.version, size_bytes=loc.size_bytes)


def event_msg(ev: Event) -> directory_pb2.Event:
    return directory_pb2.Event(
        seq=ev.seq, kind=int(ev.kind), namespace_id=ev.namespace_id, key=ev.key,
        location=location_msg(ev.location), unix_ms=ev.unix_ms, generation=ev.generation,
    )


def tier_stats(st: CoreStats) -> list[directory_pb2.TierStats]:
    """Each tier's usage and counters, as an admin's Stats answers them."""
    tiers = []
    for name, usage in st.tiers.items():
        c = st.counters.get(name, {})
        tiers.append(directory_pb2.TierStats(
            tier=name, num_pages=usage.num_pages, used_bytes=usage.used_bytes, capacity_bytes=usage.capacity_bytes,
            hits=int(c.get("hits", 0)), misses=int(c.get("misses", 0)), evictions=int(c.get("evictions", 0)),
            bytes_in=int(c.get("bytes_in", 0)), bytes_out=int(c.get("bytes_out", 0)),
        ))
    return tiers


class DirectoryService(directory_pb2_grpc.DirectoryServicer):
    """Each handler validates its request, makes one call of the tenancy gate (tenancy/gate.py
    and gate_directory.py: the caller's checks, events, stats and quarantine lists filtered to
    its namespaces) and answers; exceptions become statuses in rpc_errors.py."""

    def __init__(self, core: Placement, config: ServerConfig, gate: Gate) -> None:
        self.core = core
        self.config = config
        self.gate = gate
        self.metrics = core.metrics
        self._subscribers = 0
        self._subscribers_lock = threading.Lock()

    def _keys(self, values: list[bytes], allow_empty: bool = False) -> list[bytes]:
        return validate.keys(values, self.config.max_pages_per_request, allow_empty)

    @unary
    def Lookup(self, request: directory_pb2.LookupRequest, context: grpc.ServicerContext) -> directory_pb2.LookupResponse:
        ns = validate.namespace_id(request.namespace_id)
        keys = self._keys(list(request.keys))
        runs, generation = self.gate.lookup(current_identity(), ns, keys, request.local_only, request.tenant, context)
        return directory_pb2.LookupResponse(
            num_pages=sum(r.num_pages for r in runs), generation=generation,
            runs=[directory_pb2.LocationRun(node=r.node, tier=r.tier, num_pages=r.num_pages, size_bytes=r.size_bytes)
                  for r in runs])

    @unary
    def Publish(self, request: directory_pb2.PublishRequest, context: grpc.ServicerContext) -> directory_pb2.PublishResponse:
        ns = validate.namespace_id(request.namespace_id)
        keys = self._keys([r.key for r in request.records])
        generation = request.generation if request.HasField("generation") else None
        versions = self.gate.publish(current_identity(), ns, lambda: self._records(keys, request), request.tenant, generation,
                                     request.epoch, request.owner_epoch)
        return directory_pb2.PublishResponse(versions=versions)

    def _records(self, keys: list[bytes], request: directory_pb2.PublishRequest) -> list[Record]:
        """Each record's key, node, tier and size; checked once the caller's node right is (Gate.publish)."""
        records = []
        for key, rec in zip(keys, request.records):
            validate.tier(rec.location.tier, TIER_NAMES)
            if not rec.location.node or not rec.location.tier:
                raise InvalidRequest("every published location needs a node and a tier")
            if len(rec.location.node) > MAX_NODE_NAME:
                raise InvalidRequest(f"node names are at most {MAX_NODE_NAME} characters, got {len(rec.location.node)}")
            records.append((key, rec.location.node, rec.location.tier, rec.location.size_bytes))
        return records

    @unary
    def Remove(self, request: directory_pb2.RemoveRequest, context: grpc.ServicerContext) -> directory_pb2.RemoveResponse:
        ns = validate.namespace_id(request.namespace_id)
        tier = validate.tier(request.tier, TIER_NAMES)
        keys = self._keys(list(request.keys))
        removed = self.gate.remove(current_identity(), ns, keys, tier, request.node, request.epoch, request.owner_epoch)
        return directory_pb2.RemoveResponse(num_removed=removed)

    @unary
    def Invalidate(self, request: directory_pb2.InvalidateRequest, context: grpc.ServicerContext) -> directory_pb2.InvalidateResponse:
        ns = validate.namespace_id(request.namespace_id)
        keys = self._keys(list(request.keys), allow_empty=True)
        removed, generation = self.gate.invalidate(current_identity(), ns, keys, request.generation, context)
        return directory_pb2.InvalidateResponse(num_removed=removed, generation=generation)

    @stream
    def Subscribe(self, request: directory_pb2.SubscribeRequest, context: grpc.ServicerContext) -> Iterator[directory_pb2.Event]:
        # A share of the stream slots (service_streams), so that routers leave room for page streams.
        who = current_identity()
        with self._subscriber():
            for ev in self.gate.events(who, request.from_seq, context):
                yield event_msg(ev)

    @contextmanager
    def _subscriber(self) -> Iterator[None]:
        """One of at most --max-subscribers: LimitExceeded past it."""
        with self._subscribers_lock:
            if self._subscribers >= self.config.max_subscribers:
                raise LimitExceeded(f"too many subscribers ({self._subscribers}); at most {self.config.max_subscribers}")
            self._subscribers += 1
        try:
            yield
        finally:
            with self._subscribers_lock:
                self._subscribers -= 1

    @unary
    def Stats(self, request: directory_pb2.StatsRequest, context: grpc.ServicerContext) -> directory_pb2.StatsResponse:
        """An admin's figures, or a tenant's own (the gate's ``stats``, tenancy/gate_directory.py)."""
        st, tenants = self.gate.stats(current_identity())
        return directory_pb2.StatsResponse(
            node=st.node, num_entries=st.num_entries, last_seq=st.last_seq, tiers=tier_stats(st),
            num_leases=st.num_leases, num_quarantined=st.num_quarantined, ssd=st.ssd,
            tenants=[directory_pb2.TenantUsage(tenant=t, used=used, limits=limits) for t, used, limits in tenants],
        )

    @unary
    def Quarantine(self, request: directory_pb2.QuarantineRequest, context: grpc.ServicerContext) -> directory_pb2.QuarantineResponse:
        pages, purged = self.gate.quarantine(current_identity(), request.purge)
        return directory_pb2.QuarantineResponse(
            purged=purged,
            pages=[directory_pb2.QuarantinedPage(key=q.key, namespace_id=q.namespace_id, reason=q.reason, unix_s=q.unix_s) for q in pages],
        )
