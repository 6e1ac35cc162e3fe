"""The Directory servicer: a thin adapter from gRPC messages to the directory and the placement core."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import grpc

from kvstore import validate
from kvstore._proto import common_pb2, directory_pb2, directory_pb2_grpc
from kvstore.config import ServerConfig
from kvstore.directory import Event, EventKind
from kvstore.errors import InvalidRequest, LimitExceeded
from kvstore.security.identity import Identity, Rights
from kvstore.security.interceptor import current_identity
from kvstore.server.placement import Placement
from kvstore.server.services.rpc_errors import stream, unary
from kvstore.server.services.tenant_stats import tenant_stats, tenant_usage
from kvstore.server.tenancy import Tenancy
from kvstore.server.tenancy.cluster_reads import ClusterReads
from kvstore.server.tenancy.node_calls import acting_for, require_node
from kvstore.types import TIER_NAMES, Location

if TYPE_CHECKING:  # cluster mode is imported only when the server runs it
    from kvstore.server.cluster import ClusterRuntime

_SUBSCRIBE_POLL_S = 0.5
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


class DirectoryService(directory_pb2_grpc.DirectoryServicer):
    """Each handler reads its caller first and checks it against the namespace the request
    names; events, stats and quarantine lists are filtered to the caller's namespaces (see
    kvstore/server/tenancy/access.py)."""

    def __init__(self, core: Placement, config: ServerConfig, tenancy: Tenancy, cluster: ClusterRuntime | None = None) -> None:
        self.core = core
        self.config = config
        self.tenancy = tenancy
        self.cluster = cluster  # a ClusterRuntime in cluster mode: lookups span the shard owners
        self.cluster_reads = ClusterReads(tenancy, cluster) if cluster is not None else None
        self.metrics = core.metrics
        self._subscribers = 0
        self._subscribers_lock = threading.Lock()

    def _admitting(self, nodes: list[str], epoch: int, owner_epoch: int) -> AbstractContextManager[None]:
        """A node's calls name its epoch and the one of this node it heard of: a call of an
        incarnation that is over, or to one, is refused."""
        return self.cluster.incarnations.admitting(nodes, epoch, owner_epoch) if self.cluster is not None else nullcontext()

    def _keys(self, values: list[bytes], allow_empty: bool = False) -> list[bytes]:
        return validate.keys(values, self.config.max_pages_per_request, allow_empty)

    @unary
    def Lookup(self, request: directory_pb2.LookupRequest, context: grpc.ServicerContext) -> directory_pb2.LookupResponse:
        ns = validate.namespace_id(request.namespace_id)
        keys = self._keys(list(request.keys))
        who = current_identity()
        generation = self.core.directory.generation(ns)  # read first: runs of an older one are never labelled newer
        if request.local_only or request.tenant:  # a node asking a shard owner
            require_node(who, "Lookup with local_only or tenant")
            if not self.tenancy.may_read(acting_for(who, request.tenant), ns):
                return directory_pb2.LookupResponse(num_pages=0)
            runs = self.cluster.owner_lookup(ns, keys) if self.cluster is not None else self.core.directory.lookup(ns, keys)
        elif self.cluster_reads is not None:
            runs = self.cluster_reads.lookup(who, ns, keys, context.time_remaining())
        elif self.tenancy.may_read(who, ns):
            runs = self.core.directory.lookup(ns, keys)  # the directory's lock only
        else:
            runs = []  # as for an empty namespace
        return directory_pb2.LookupResponse(
            num_pages=sum(r.num_pages for r in runs), generation=generation,
            runs=[directory_pb2.LocationRun(node=r.node, tier=r.tier, num_pages=r.num_pages, size_bytes=r.size_bytes)
                  for r in runs])

    @unary
    def Publish(self, request: directory_pb2.PublishRequest, context: grpc.ServicerContext) -> directory_pb2.PublishResponse:
        ns = validate.namespace_id(request.namespace_id)
        keys = self._keys([r.key for r in request.records])
        who = current_identity()
        require_node(who, "Publish")
        records = []
        for key, rec in zip(keys, request.records):
            validate.tier(rec.location.tier, TIER_NAMES)
            if not rec.location.node or not rec.location.tier:
                raise InvalidRequest("every published location needs a node and a tier")
            if len(rec.location.node) > MAX_NODE_NAME:
                raise InvalidRequest(f"node names are at most {MAX_NODE_NAME} characters, got {len(rec.location.node)}")
            records.append((key, rec.location.node, rec.location.tier, rec.location.size_bytes))
        who = acting_for(who, request.tenant)  # the records' tenant: bound here to it, within its quota
        generation = validate.generation(request.generation) if request.HasField("generation") else None
        if generation is not None:  # a newer one than this node's: entered here first (the sender learned it from etcd)
            self.core.enter_generation(ns, generation)
        with self.tenancy.quotas.reserving(who, published_records=len(records)), self.tenancy.writing(who, ns), \
                self._admitting([r[1] for r in records], request.epoch, request.owner_epoch):
            versions = self.core.publish_remote(ns, records, generation)
        return directory_pb2.PublishResponse(versions=versions)

    @unary
    def Remove(self, request: directory_pb2.RemoveRequest, context: grpc.ServicerContext) -> directory_pb2.RemoveResponse:
        ns = validate.namespace_id(request.namespace_id)
        tier = validate.tier(request.tier, TIER_NAMES)
        keys = self._keys(list(request.keys))
        who = current_identity()
        if request.node:  # a node withdrawing its records from a shard owner
            require_node(who, "Remove with node")
            with self._admitting([request.node], request.epoch, request.owner_epoch):
                return directory_pb2.RemoveResponse(num_removed=self.core.withdraw_remote(ns, request.node, keys, tier))
        if not self.tenancy.may_administer(who, ns):
            return directory_pb2.RemoveResponse(num_removed=0)  # as for an empty namespace
        return directory_pb2.RemoveResponse(num_removed=self.core.remove(ns, keys, tier))

    @unary
    def Invalidate(self, request: directory_pb2.InvalidateRequest, context: grpc.ServicerContext) -> directory_pb2.InvalidateResponse:
        ns = validate.namespace_id(request.namespace_id)
        keys = self._keys(list(request.keys), allow_empty=True)
        who = current_identity()
        if request.generation:  # a node that raised the generation in etcd, telling this one
            require_node(who, "Invalidate with a generation")
            removed = self.core.enter_generation(ns, validate.generation(request.generation)) or 0
            return directory_pb2.InvalidateResponse(num_removed=removed, generation=self.core.directory.generation(ns))
        if keys and self.cluster is not None:
            raise InvalidRequest("Invalidate with keys is local to one node, and another node's copy would be fetched "
                                 "straight back: in cluster mode invalidate the whole namespace (no keys; its generation "
                                 "goes up at every node)")
        if not (self.tenancy.may_administer(who, ns) or self._elsewhere(who, ns)):  # as for an empty namespace
            return directory_pb2.InvalidateResponse(num_removed=0, generation=self.core.directory.generation(ns))
        if self.cluster is not None:  # etcd first, then every member, before this answers
            removed, generation = self.cluster.invalidate(ns, context.time_remaining())
        else:
            removed, generation = self.core.invalidate(ns, keys), self.core.directory.generation(ns)
        return directory_pb2.InvalidateResponse(num_removed=removed, generation=generation)

    def _elsewhere(self, who: Identity, namespace_id: bytes) -> bool:
        """Cluster mode: a tenant's namespace bound to nobody at this node may be its own at
        another (it wrote there): it may invalidate it here. Its id folds in the tenant's
        secret salt, so another tenant cannot name it without a leak."""
        return self.cluster is not None and who.via != "local" and self.tenancy.owners.owner(namespace_id) is None

    @stream
    def Subscribe(self, request: directory_pb2.SubscribeRequest, context: grpc.ServicerContext) -> Iterator[directory_pb2.Event]:
        # A share of the stream slots (service_streams), so that routers leave room for page streams.
        who = current_identity()
        sees = self.tenancy.sees
        with self._subscribers_lock:
            if self._subscribers >= self.config.max_subscribers:
                raise LimitExceeded(f"too many subscribers ({self._subscribers}); at most {self.config.max_subscribers}")
            self._subscribers += 1
        try:
            events = self.core.directory.events
            next_seq = request.from_seq or events.last_seq + 1
            while context.is_active() and not events.closed:
                batch = events.wait_since(next_seq, _SUBSCRIBE_POLL_S)
                for ev in batch:
                    if ev.kind == EventKind.RESYNC or sees(who, ev.namespace_id):
                        yield event_msg(ev)
                    next_seq = max(next_seq, ev.seq + 1)
        finally:
            with self._subscribers_lock:
                self._subscribers -= 1

    @unary
    def Stats(self, request: directory_pb2.StatsRequest, context: grpc.ServicerContext) -> directory_pb2.StatsResponse:
        who = current_identity()
        if not who.allows(Rights.ADMIN):
            return tenant_stats(self.core, self.tenancy, who)
        st = self.core.stats()
        tiers = []
        for name, usage in st.tiers.items():
            c = st.counters.get(name, {})
            tiers.append(directory_pb2.TierStats(
                tier=name, num_pages=usage.num_pages, used_bytes=usage.used_bytes, capacity_bytes=usage.capacity_bytes,
                hits=int(c.get("hits", 0)), misses=int(c.get("misses", 0)), evictions=int(c.get("evictions", 0)),
                bytes_in=int(c.get("bytes_in", 0)), bytes_out=int(c.get("bytes_out", 0)),
            ))
        return directory_pb2.StatsResponse(
            node=st.node, num_entries=st.num_entries, last_seq=st.last_seq, tiers=tiers,
            num_leases=st.num_leases, num_quarantined=st.num_quarantined, ssd=st.ssd,
            tenants=[tenant_usage(self.tenancy, t) for t in self.tenancy.tenants()],
        )

    @unary
    def Quarantine(self, request: directory_pb2.QuarantineRequest, context: grpc.ServicerContext) -> directory_pb2.QuarantineResponse:
        who = current_identity()
        if request.purge:
            self.tenancy.check_purge(who)
        pages = [q for q in self.core.quarantined() if self.tenancy.sees(who, q.namespace_id)]
        purged = self.core.purge_quarantine() if request.purge else 0
        return directory_pb2.QuarantineResponse(
            purged=purged,
            pages=[directory_pb2.QuarantinedPage(key=q.key, namespace_id=q.namespace_id, reason=q.reason, unix_s=q.unix_s) for q in pages],
        )
