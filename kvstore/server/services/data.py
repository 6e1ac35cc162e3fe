"""The Data servicer: arena slots for same-host clients, page streams for the others."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from kvstore import validate
from kvstore._proto import data_pb2, data_pb2_grpc
from kvstore.config import ServerConfig
from kvstore.errors import InvalidRequest, PermissionDenied
from kvstore.page import checksum
from kvstore.page_wire.grpc_chunks import CHUNK_BYTES, WireChunk, check_chunk_bytes, checked_page_chunks
from kvstore.security.identity import Identity, Rights
from kvstore.security.interceptor import current_identity
from kvstore.server.handoff_markers import HandoffMarkers
from kvstore.server.placement import Placement
from kvstore.server.placement.reported import MAX_REPORTED, ReportBudget, check_reported
from kvstore.server.services.cluster_reads import ClusterReads
from kvstore.server.services.fetch_room import quota_landing
from kvstore.server.services.node_calls import MAX_NODE_ID, MAX_REPLICAS, acting_for, on_behalf, require_node
from kvstore.server.services.page_writes import PageWrites
from kvstore.server.services.read_ahead import built_ahead
from kvstore.server.services.room import room
from kvstore.server.services.rpc_errors import stream, unary
from kvstore.server.services.session_log import SessionCalls
from kvstore.server.services.session_saves import committing
from kvstore.server.services.shared_memory import SharedMemory
from kvstore.server.session_owners import SessionOwners
from kvstore.server.tenancy import Tenancy
from kvstore.server.tenancy.quotas import NOTHING
from kvstore.server.tokenlog import TokenLog

if TYPE_CHECKING:  # cluster mode is imported only when the server runs it
    from kvstore.server.cluster import ClusterRuntime


class DataService(SessionCalls, data_pb2_grpc.DataServicer):
    """Each handler reads its caller first and checks it against the namespace (tenancy/access.py)."""

    def __init__(self, core: Placement, config: ServerConfig, wal: TokenLog, tenancy: Tenancy, session_owners: SessionOwners,
                 handoffs: HandoffMarkers | None = None, cluster: ClusterRuntime | None = None, arena_socket: Path | None = None,
                 pool_socket: Path | None = None, call_socket: Path | None = None, call_token: bytes = b"") -> None:
        self.core = core
        self.session_owners = session_owners  # who owns each migrated session here (DESIGN §12.8)
        self.handoffs = handoffs  # a handoff's pages are let go once its waiter acquired them (DESIGN §12.7)
        self.arena_socket = arena_socket  # with tenant arenas: where a same-host caller fetches its own
        self.memory = SharedMemory(core, config, tenancy, arena_socket, pool_socket)  # its arena and hbm pool
        self.call_socket, self.call_token = call_socket, call_token  # the same-host call socket (kvstore/callsocket/socket_server.py), announced
        self.config = config
        self.cluster = cluster  # a ClusterRuntime in cluster mode: Acquire fetches pages other nodes hold
        self.cluster_reads = ClusterReads(tenancy, cluster) if cluster is not None else None
        self.metrics = core.metrics
        self.wal = wal
        self.tenancy = tenancy
        self.quotas = tenancy.quotas
        self._read_ahead = ThreadPoolExecutor(max_workers=2, thread_name_prefix="read-ahead")  # ReadPages' next page
        self._reports = ReportBudget()  # pages readers report failing, checked per tenant
        self.page_writes = PageWrites(core, tenancy, session_owners)  # WritePages' streams

    def close(self) -> None:  # once no call runs (the gRPC server stopped): the read-ahead workers end
        self._read_ahead.shutdown(wait=True)

    def _keys(self, values: list[bytes]) -> list[bytes]:
        return validate.keys(values, self.config.max_pages_per_request)

    @unary
    def GetInfo(self, request: data_pb2.GetInfoRequest, context: grpc.ServicerContext) -> data_pb2.GetInfoResponse:
        """The caller's arena and pool: one trust domain each (shared_memory.py)."""
        who = current_identity()
        info = data_pb2.GetInfoResponse(node=self.core.node, tiers=list(self.config.tiers),
                                        max_pages_per_request=self.config.max_pages_per_request,
                                        max_page_bytes=self.config.max_page_bytes)
        self.memory.describe(who, info)
        if self.call_socket is not None:
            info.call_socket, info.call_token = str(self.call_socket), self.call_token
        return info

    @unary
    def WhoAmI(self, request: data_pb2.WhoAmIRequest, context: grpc.ServicerContext) -> data_pb2.WhoAmIResponse:
        who = current_identity()
        return data_pb2.WhoAmIResponse(tenant=who.tenant, rights=who.rights.names(), salt=who.salt)

    @unary
    def Allocate(self, request: data_pb2.AllocateRequest, context: grpc.ServicerContext) -> data_pb2.AllocateResponse:
        ns = validate.namespace_id(request.namespace_id)
        layout = validate.layout(request.layout)
        keys = self._keys(list(request.keys))
        parent = validate.keys([request.parent], 1)[0] if request.parent else None
        generation = validate.generation(request.generation) if request.HasField("generation") else None
        who = current_identity()
        if request.session_id and self.tenancy.sees(who, ns):  # a session fenced here (live migration): refused, to its tenant
            self.session_owners.check(ns, request.session_id, "Allocate")
        held = room(self.quotas, self.core, who, len(keys), layout.page_bytes, context)
        try:
            with self.tenancy.writing(who, ns):
                ident, slots = self.core.allocate(ns, layout, keys, who.tenant, parent, self.quotas.handing_over(held),
                                                  generation)
        finally:
            held.release()  # handed over to the allocation's slots (or there are none)
        if not context.is_active():  # its deadline passed while room was made: nobody hears of it (a gRPC caller)
            self.core.abort(ident, who.tenant)
        alloc = self.core.leases.allocation(ident)
        if alloc is not None and request.session_id:  # kept for its Commit: refused if the session is fenced by then
            alloc.session_id = request.session_id
        arena = self.memory.arena(who)
        return data_pb2.AllocateResponse(
            allocation_id=ident, page_bytes=layout.page_bytes, ttl_ms=self.core.config.allocation_ttl_ms,
            arena_token=arena.token if arena is not None else b"",
            generation=alloc.generation if alloc is not None else self.core.directory.generation(ns),
            slots=[data_pb2.Slot(key=k, offset=0 if o is None else self.core.landing.at(o).offset(o), exists=o is None)
                   for k, o in slots],
        )

    @unary
    def Commit(self, request: data_pb2.CommitRequest, context: grpc.ServicerContext) -> data_pb2.CommitResponse:
        keys = validate.keys(list(request.keys), self.config.max_pages_per_request, allow_empty=True)
        who = current_identity()
        alloc = self.core.leases.allocation(request.allocation_id)
        mine = alloc is not None and alloc.tenant == who.tenant
        bridge = NOTHING
        with committing(self.session_owners, self.core, request.allocation_id, alloc.namespace_id if alloc else b"",
                        alloc.session_id if mine and alloc else "", "Commit", who.tenant):  # before the fence, or refused after
            if mine and alloc is not None and who.via != "local":
                self._check_written(request.allocation_id, alloc.slots, keys, list(request.checksums))
                bridge = self.quotas.hold(who, host_bytes=len(alloc.slots) * alloc.layout.page_bytes)
            try:  # the slots' bytes stay counted while they become pages (ssd quotas: see tenancy/ssd_share.py)
                n = self.core.commit(request.allocation_id, keys, list(request.checksums), request.durable, request.flags,
                                     tenant=who.tenant, counting=self.quotas.handing_over(bridge))
            finally:
                bridge.release()
        return data_pb2.CommitResponse(num_published=n)

    def _check_written(self, allocation_id: bytes, slots: dict[bytes, int], keys: list[bytes], checksums: list[int]) -> None:
        """A tenant's commit is checked against the bytes in its slots: a freed slot keeps the
        bytes of the page that left it (maybe another tenant's), and a commit that claims a
        checksum without writing them must not publish those bytes under the caller's key. With
        an arena per tenant a slot only ever held the tenant's own pages: nothing to check (a
        page committed with a wrong checksum fails the checks before it is sent or demoted)."""
        if self.arena_socket is not None:
            return
        for key, expected in zip(keys, checksums):
            if key in slots and checksum(self.core.slot_view(allocation_id, key)) != expected:
                raise InvalidRequest(f"page {key.hex()}: the checksum does not match the bytes in its slot; "
                                     "nothing was committed (write the page, then commit)")

    @unary
    def Abort(self, request: data_pb2.AbortRequest, context: grpc.ServicerContext) -> data_pb2.AbortResponse:
        self.core.abort(request.allocation_id, current_identity().tenant)
        return data_pb2.AbortResponse()

    @unary
    def Acquire(self, request: data_pb2.AcquireRequest, context: grpc.ServicerContext) -> data_pb2.AcquireResponse:
        ns = validate.namespace_id(request.namespace_id)
        keys = self._keys(list(request.keys))
        who = current_identity()
        self.memory.check_arena(who, ns)
        device = self.memory.device(who, request)
        with self.quotas.reserving(who, leases=1):
            if not self._readable(who, ns, keys, context):
                keys = []  # as for an empty namespace
            ident, pages = self.core.acquire(ns, keys, request.ttl_ms, tenant=who.tenant, device=device)
        self.quotas.used(who, [p.key for p in pages])
        if self.handoffs is not None:
            self.handoffs.acquired(who.tenant, ns, [p.key for p in pages])
        return self.memory.acquired(who, ident, pages, device)

    def _readable(self, who: Identity, ns: bytes, keys: list[bytes], context: grpc.ServicerContext) -> bool:
        """Whether ``who`` may read the namespace; in cluster mode, after fetching what other
        nodes hold of ``keys`` into this node's host tier (cluster_reads.py)."""
        if self.cluster_reads is None:
            return self.tenancy.may_read(who, ns)
        return self.cluster_reads.fill(who, ns, keys, context.time_remaining())

    @unary
    def Release(self, request: data_pb2.ReleaseRequest, context: grpc.ServicerContext) -> data_pb2.ReleaseResponse:
        if request.failed:  # a reader's copy failed (placement/reported.py): checked if the lease holds it, within budget
            tenant = current_identity().tenant
            check_reported(self.core, request.lease_id, tenant, list(request.failed[:MAX_REPORTED]), lambda: self._reports.take(tenant))
        self.core.release(request.lease_id, current_identity().tenant)
        return data_pb2.ReleaseResponse()

    @unary
    def Renew(self, request: data_pb2.RenewRequest, context: grpc.ServicerContext) -> data_pb2.RenewResponse:
        self.core.renew(request.lease_id, request.ttl_ms, current_identity().tenant)
        return data_pb2.RenewResponse()

    @unary
    def WritePages(self, request_iterator: Iterator[WireChunk], context: grpc.ServicerContext) -> data_pb2.WritePagesResponse:
        """Pages allocated and committed a group at a time, each filled and checked as its bytes pass (page_writes.py)."""
        return data_pb2.WritePagesResponse(num_published=self.page_writes.write(request_iterator, current_identity()))

    @unary
    def Hint(self, request: data_pb2.HintRequest, context: grpc.ServicerContext) -> data_pb2.HintResponse:
        ns = validate.namespace_id(request.namespace_id)
        if len(request.entries) > self.config.max_pages_per_request:
            raise InvalidRequest(f"too many hint entries: {len(request.entries)}")
        who = current_identity()
        readable = self.tenancy.may_read(who, ns)
        max_eta_ms = int(self.config.max_hint_eta_s * 1000)
        entries = []  # every entry is checked before any is applied
        for i, entry in enumerate(request.entries):
            if entry.eta_ms > max_eta_ms:
                raise InvalidRequest(f"entries[{i}].eta_ms {entry.eta_ms} is beyond the maximum of {max_eta_ms} ms (--max-hint-eta-s)")
            entries.append((self._keys(list(entry.keys)), entry.eta_ms / 1000))
        if not readable:  # an empty namespace has nothing to prefetch: every entry is answered reserved
            return data_pb2.HintResponse(reserved=[True] * len(entries))
        with self.quotas.hinting(who, entries):  # all of it, or none: a Hint the server refuses is not charged
            reserved = self.core.hint_entries(ns, entries)
        if self.cluster_reads is not None:  # pages held on other nodes are fetched ahead too, without waiting
            for (keys, _), ok in zip(entries, reserved):
                if ok:
                    self.cluster_reads.prefetch(who, ns, keys)
        return data_pb2.HintResponse(reserved=reserved)

    @unary
    def Replicate(self, request: data_pb2.ReplicateRequest, context: grpc.ServicerContext) -> data_pb2.ReplicateResponse:
        """A client's ``put(replicas=n)``: other members copy the caller's pages held here
        (kvstore/server/cluster/replicas.py). With ``holder`` (the node right): this node is
        such a member, and fetches the pages from the holder for the tenant named."""
        ns = validate.namespace_id(request.namespace_id)
        keys = self._keys(list(request.keys))
        if not 1 <= request.replicas <= MAX_REPLICAS:
            raise InvalidRequest(f"replicas must be 1..{MAX_REPLICAS}, got {request.replicas}")
        who = current_identity()
        if request.holder or request.tenant:
            require_node(who, "Replicate from a holder")
            return data_pb2.ReplicateResponse(num_pages=self._copy_from(acting_for(who, request.tenant), ns, keys, request, context))
        if not who.allows(Rights.WRITE):
            raise PermissionDenied(f"tenant {who.tenant!r} lacks the write right (replicas are writes on other nodes)")
        if self.cluster is None:
            if request.replicas > 1:
                raise InvalidRequest("replicas > 1 needs cluster mode (--cluster)")
            held = self.core.directory.lookup(ns, keys) if self.tenancy.may_read(who, ns) else []
            return data_pb2.ReplicateResponse(num_pages=sum(r.num_pages for r in held))
        if not self.tenancy.may_read(who, ns):
            return data_pb2.ReplicateResponse(num_pages=0)  # as for an empty namespace
        n = self.cluster.replicate(ns, keys, request.replicas, context.time_remaining(), on_behalf(who))
        return data_pb2.ReplicateResponse(num_pages=n)

    @unary
    def GrantTransfer(self, request: data_pb2.GrantTransferRequest, context: grpc.ServicerContext) -> data_pb2.GrantTransferResponse:
        """A node's one-time grant for a connection to this node's UCX or TCP data port (kvstore/cluster/grants.py)."""
        require_node(current_identity(), "GrantTransfer")
        if self.cluster is None or self.cluster.grants is None:
            raise InvalidRequest("GrantTransfer needs cluster mode with --data-plane ucx or tcp")
        if not 0 < len(request.node) <= MAX_NODE_ID:
            raise InvalidRequest(f"GrantTransfer names a node id of 1..{MAX_NODE_ID} characters, got {len(request.node)}")
        grants = self.cluster.grants
        return data_pb2.GrantTransferResponse(grant=grants.issue(request.node), ttl_ms=int(grants.ttl_s * 1000))

    def _copy_from(self, who: Identity, ns: bytes, keys: list[bytes], request: data_pb2.ReplicateRequest,
                   context: grpc.ServicerContext) -> int:
        """The namespace is claimed for the tenant before the copy and bound only if pages arrived."""
        if self.cluster is None or request.page_bytes <= 0:
            raise InvalidRequest("Replicate with a holder needs cluster mode and page_bytes")
        claimed = self.tenancy.claim(who, ns)
        held = 0
        try:
            held = self.cluster.copy_from(request.holder, ns, keys, request.page_bytes, context.time_remaining(), on_behalf(who),
                                          quota_landing(self.quotas, self.core, who, ns, keys))  # within its host quota
        finally:
            if claimed:
                self.tenancy.settle(who, ns, held > 0)
        return held

    @stream
    def ReadPages(self, request: data_pb2.ReadPagesRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        ns = validate.namespace_id(request.namespace_id)
        keys = self._keys(list(request.keys))
        chunk_bytes = request.chunk_bytes or CHUNK_BYTES
        check_chunk_bytes(chunk_bytes)
        who = current_identity()
        node_call = request.local_only or bool(request.tenant)  # a node fetching for one of its tenants
        if node_call:
            require_node(who, "ReadPages with local_only or tenant")
            who = acting_for(who, request.tenant)
            if request.HasField("generation"):  # the reader's: a newer one is entered here, an older one refused
                self.core.read_generation(ns, validate.generation(request.generation))
        with self.quotas.reserving(who, leases=1):
            if not (self.tenancy.may_read(who, ns) if node_call else self._readable(who, ns, keys, context)):
                keys = []  # as for an empty namespace
            ident, pages = self.core.acquire(ns, keys, request.ttl_ms, tenant=who.tenant)
        self.quotas.used(who, [p.key for p in pages])
        if self.handoffs is not None and not node_call:
            self.handoffs.acquired(who.tenant, ns, [p.key for p in pages])

        def build(page: Any) -> list[bytes] | None:
            header = page.header
            return checked_page_chunks(header.key, header.namespace_id, validate.layout_msg(header.layout),
                                       self.core.read_view(page), header.checksum, chunk_bytes)

        # Each page checked as it is copied out (the next one while this one is sent): a slot
        # scribbled on is quarantined, not sent. closing(): the build in flight ends before the
        # lease is released, however the stream ends.
        try:
            with closing(built_ahead(pages, build, self._read_ahead)) as built:
                for page, chunks in zip(pages, built):
                    if chunks is None:  # quarantined, unless the key was stored again elsewhere meanwhile
                        self.core.reads.quarantine_landing(page.header, "its bytes in the arena do not match its checksum "
                                                           "(checked before sending)", page.slot)
                        break
                    yield from chunks
        finally:
            self.core.release(ident)
