"""The Data servicer: arena slots for same-host clients, page streams for the others."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import grpc

from kvstore import validate
from kvstore._proto import common_pb2, data_pb2, data_pb2_grpc
from kvstore.config import ServerConfig
from kvstore.errors import InvalidRequest
from kvstore.page import LayoutDesc
from kvstore.page_wire.grpc_chunks import CHUNK_BYTES, WireChunk, check_chunk_bytes, checked_page_chunks, page_chunks
from kvstore.security.interceptor import current_identity
from kvstore.server.placement import Placement
from kvstore.server.placement.reads import AcquiredPage
from kvstore.server.placement.reported import MAX_REPORTED
from kvstore.server.services.page_writes import PageWrites
from kvstore.server.services.read_ahead import built_ahead, map_now
from kvstore.server.services.rpc_errors import stream, unary
from kvstore.server.services.session_log import SessionCalls
from kvstore.server.tenancy.gate import Gate
from kvstore.server.tenancy.node_calls import MAX_REPLICAS


class DataService(SessionCalls, data_pb2_grpc.DataServicer):
    """Each handler validates its request, makes one call of the tenancy gate (tenancy/gate.py)
    or the core, and answers; exceptions become statuses in rpc_errors.py."""

    def __init__(self, core: Placement, config: ServerConfig, gate: Gate, call_socket: Path | None = None,
                 call_token: bytes = b"") -> None:
        self.core = core
        self.gate = gate  # each call's caller resolved, quota reserved, core called, settled; its arena and pool too
        self.call_socket, self.call_token = call_socket, call_token  # the same-host call socket (kvstore/callsocket/socket_server.py), announced
        self.config = config
        self.metrics = core.metrics
        self._read_ahead = ThreadPoolExecutor(max_workers=2, thread_name_prefix="read-ahead")  # ReadPages' next page
        self.page_writes = PageWrites(core, gate)  # WritePages' streams

    def close(self) -> None:  # once no call runs (the gRPC server stopped): the read-ahead workers end
        self._read_ahead.shutdown(wait=True)

    def _keys(self, values: list[bytes]) -> list[bytes]:
        return validate.keys(values, self.config.max_pages_per_request)

    @unary
    def GetInfo(self, request: data_pb2.GetInfoRequest, context: grpc.ServicerContext) -> data_pb2.GetInfoResponse:
        """The caller's arena and pool: one trust domain each (tenancy/gate_arenas.py)."""
        memory = self.gate.memory_info(current_identity())
        info = data_pb2.GetInfoResponse(node=self.core.node, tiers=list(self.config.tiers),
                                        max_pages_per_request=self.config.max_pages_per_request,
                                        max_page_bytes=self.config.max_page_bytes, arena_path=memory.arena_path,
                                        arena_socket=memory.arena_socket, arena_bytes=memory.arena_bytes,
                                        arena_token=memory.arena_token, pool_socket=memory.pool_socket)
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
        ident, slots, alloc, arena_token = self.gate.allocate(current_identity(), ns, layout, keys, parent, generation,
                                                              request.session_id, context)
        return data_pb2.AllocateResponse(
            allocation_id=ident, page_bytes=layout.page_bytes, ttl_ms=self.core.config.allocation_ttl_ms,
            arena_token=arena_token, slots=self._slots(slots),
            generation=alloc.generation if alloc is not None else self.core.directory.generation(ns))

    def _slots(self, slots: list[tuple[bytes, int | None]]) -> list[data_pb2.Slot]:
        """Each slot's offset in its arena; a page stored already has none (``exists``)."""
        return [data_pb2.Slot(key=k, offset=0 if o is None else self.core.landing.at(o).offset(o), exists=o is None)
                for k, o in slots]

    @unary
    def Commit(self, request: data_pb2.CommitRequest, context: grpc.ServicerContext) -> data_pb2.CommitResponse:
        keys = validate.keys(list(request.keys), self.config.max_pages_per_request, allow_empty=True)
        n = self.gate.commit(current_identity(), request.allocation_id, keys, list(request.checksums), request.durable,
                             request.flags)
        return data_pb2.CommitResponse(num_published=n)

    @unary
    def Abort(self, request: data_pb2.AbortRequest, context: grpc.ServicerContext) -> data_pb2.AbortResponse:
        self.gate.abort(current_identity(), request.allocation_id)
        return data_pb2.AbortResponse()

    @unary
    def Acquire(self, request: data_pb2.AcquireRequest, context: grpc.ServicerContext) -> data_pb2.AcquireResponse:
        ns = validate.namespace_id(request.namespace_id)
        keys = self._keys(list(request.keys))
        got = self.gate.acquire(current_identity(), ns, keys, request.ttl_ms, context, request.device)
        return data_pb2.AcquireResponse(
            lease_id=got.lease_id, page_bytes=got.page_bytes, arena_token=got.arena_token, pool_token=got.pool_token,
            generation=got.generation,
            pages=[data_pb2.AcquiredPage(key=p.key, offset=p.offset, checksum=p.checksum, on_device=p.device_offset is not None,
                                         device_offset=p.device_offset or 0) for p in got.pages])

    @unary
    def Release(self, request: data_pb2.ReleaseRequest, context: grpc.ServicerContext) -> data_pb2.ReleaseResponse:
        # a reader's copy failed (placement/reported.py): checked if the lease holds it, within budget
        self.gate.release(current_identity(), request.lease_id, request.failed[:MAX_REPORTED])
        return data_pb2.ReleaseResponse()

    @unary
    def Renew(self, request: data_pb2.RenewRequest, context: grpc.ServicerContext) -> data_pb2.RenewResponse:
        self.gate.renew(current_identity(), request.lease_id, request.ttl_ms, request.layers_written)
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
        return data_pb2.HintResponse(reserved=self.gate.hint(current_identity(), ns, lambda: self._hint_entries(request)))

    def _hint_entries(self, request: data_pb2.HintRequest) -> list[tuple[list[bytes], float]]:
        """Each entry's keys and eta in seconds; checked once the caller's read right is (Gate.hint)."""
        max_eta_ms = int(self.config.max_hint_eta_s * 1000)
        entries = []
        for i, entry in enumerate(request.entries):
            if entry.eta_ms > max_eta_ms:
                raise InvalidRequest(f"entries[{i}].eta_ms {entry.eta_ms} is beyond the maximum of {max_eta_ms} ms (--max-hint-eta-s)")
            entries.append((self._keys(list(entry.keys)), entry.eta_ms / 1000))
        return entries

    @unary
    def Replicate(self, request: data_pb2.ReplicateRequest, context: grpc.ServicerContext) -> data_pb2.ReplicateResponse:
        """A client's ``put(replicas=n)``, or a node's copy from a holder (Gate.replicate)."""
        ns = validate.namespace_id(request.namespace_id)
        keys = self._keys(list(request.keys))
        if not 1 <= request.replicas <= MAX_REPLICAS:
            raise InvalidRequest(f"replicas must be 1..{MAX_REPLICAS}, got {request.replicas}")
        n = self.gate.replicate(current_identity(), ns, keys, request.replicas, request.holder, request.tenant,
                                request.page_bytes, context)
        return data_pb2.ReplicateResponse(num_pages=n)

    @unary
    def GrantTransfer(self, request: data_pb2.GrantTransferRequest, context: grpc.ServicerContext) -> data_pb2.GrantTransferResponse:
        """A node's one-time grant for a connection to this node's UCX or TCP data port (kvstore/cluster/grants.py)."""
        grant, ttl_ms = self.gate.grant_transfer(current_identity(), request.node)
        return data_pb2.GrantTransferResponse(grant=grant, ttl_ms=ttl_ms)

    @stream
    def ReadPages(self, request: data_pb2.ReadPagesRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        ns = validate.namespace_id(request.namespace_id)
        keys = self._keys(list(request.keys))
        chunk_bytes = request.chunk_bytes or CHUNK_BYTES
        check_chunk_bytes(chunk_bytes)
        generation = request.generation if request.HasField("generation") else None
        ident, pages = self.gate.read(current_identity(), ns, keys, request.ttl_ms, context, request.local_only, request.tenant,
                                      generation)
        # unchecked: a reader that checks each page itself (a node's fill, the client library) and reads one that
        # fails again without it (DESIGN §4): the send's hash would be a second pass over the same bytes
        yield from self._send(ident, pages, chunk_bytes, checked=not request.unchecked)

    def _send(self, ident: bytes, pages: list[AcquiredPage], chunk_bytes: int, checked: bool = True) -> Iterator[bytes]:
        """Each page checked as it is copied out (the next one while this one is sent): a slot
        scribbled on is quarantined, not sent. Not ``checked``: copied out unhashed with its stored
        checksum, for a reader that checks each page itself (DESIGN §4), on this thread: that build is
        one copy, and the hop to a read-ahead worker and back cost more CPU than the overlap saved
        (services/README.md); a page is sent only if its slot still holds it once copied (quarantined
        or removed meanwhile, it is a miss: its slot waits for the lease, Residence.keep_detached, but
        its bytes are not this page's any more). closing(): the build in flight ends before the lease
        is released, however the stream ends."""
        layouts: dict[LayoutDesc, common_pb2.Layout] = {}  # one message per layout, not per page

        def build(page: AcquiredPage) -> list[bytes] | None:
            header = page.header
            layout = layouts.get(header.layout)
            if layout is None:
                layout = layouts[header.layout] = validate.layout_msg(header.layout)
            view = self.core.read_view(page)
            if not checked:
                chunks = list(page_chunks(header.key, header.namespace_id, layout, view, header.checksum, chunk_bytes=chunk_bytes))
                return chunks if self.core.landing.at(page.slot).find(header.key) == (page.slot, header) else []
            return checked_page_chunks(header.key, header.namespace_id, layout, view, header.checksum, chunk_bytes)

        try:
            with closing(built_ahead(pages, build, self._read_ahead) if checked else map_now(pages, build)) as built:
                for page, chunks in zip(pages, built):
                    if chunks is None:  # quarantined, unless the key was stored again elsewhere meanwhile
                        self.core.reads.quarantine_landing(page.header, "its bytes in the arena do not match its checksum "
                                                           "(checked before sending)", page.slot)
                        break
                    if not chunks:  # unchecked, and its slot no longer holds it: gone (a miss for this reader)
                        break
                    yield from chunks
        finally:
            self.core.release(ident)
