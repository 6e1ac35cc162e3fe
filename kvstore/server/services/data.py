"""The Data servicer: arena slots for same-host clients, page streams for the others."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from kvstore import validate
from kvstore._proto import data_pb2, data_pb2_grpc
from kvstore.config import ServerConfig
from kvstore.errors import InvalidRequest, PageCorrupt
from kvstore.page import checksum, checksummer
from kvstore.pagecopy import copy_checksum_bytes
from kvstore.server.services.errors import stream, unary
from kvstore.server.placement import TierManager
from kvstore.server.tokenlog import TokenLog
from kvstore.wire import CHUNK_BYTES, WireChunk, check_chunk_bytes, page_chunks


class _IncomingPage:
    """A page arriving over WritePages: where its bytes go (None: stored already) and the
    checksum of what arrived so far."""

    def __init__(self, key: bytes, page_bytes: int, checksum: int, durable: bool, flags: int, allocation_id: bytes,
                 dest: memoryview | None) -> None:
        self.key, self.page_bytes, self.checksum, self.durable, self.flags = key, page_bytes, checksum, durable, flags
        self.allocation_id = allocation_id
        self.dest = dest
        self.filled = 0
        self._hash = checksummer()

    def add(self, chunk: WireChunk) -> bool:
        """Takes the next chunk; True when the page is complete and its checksum holds."""
        if chunk.key != self.key or chunk.offset != self.filled:
            raise InvalidRequest(f"chunk of page {self.key.hex()} at offset {chunk.offset}, expected {self.filled}")
        end = self.filled + len(chunk.data)
        if end > self.page_bytes:
            raise InvalidRequest(f"page {self.key.hex()} got more than its {self.page_bytes} bytes")
        if end == self.page_bytes and self.filled == 0:  # the whole page in one chunk: copy and hash in one pass
            self.filled = end
            if self.dest is None:
                digest = checksum(chunk.data)
            else:
                digest = copy_checksum_bytes(self.dest, chunk.data)
            if digest != self.checksum:
                raise PageCorrupt(f"page {self.key.hex()} failed its checksum")
            return True
        if self.dest is not None:
            self.dest[self.filled : end] = chunk.data
        self._hash.update(chunk.data)
        self.filled = end
        if end < self.page_bytes:
            return False
        if self._hash.intdigest() != self.checksum:
            raise PageCorrupt(f"page {self.key.hex()} failed its checksum")
        return True

    def truncated(self) -> InvalidRequest:
        return InvalidRequest(f"page {self.key.hex()} ended after {self.filled} of {self.page_bytes} bytes")


class DataService(data_pb2_grpc.DataServicer):
    def __init__(self, manager: TierManager, config: ServerConfig, wal: TokenLog) -> None:
        self.manager = manager
        self.config = config
        self.metrics = manager.metrics
        self.wal = wal

    def _keys(self, values: list[bytes]) -> list[bytes]:
        return validate.keys(values, self.config.max_pages_per_request)

    @unary
    def GetInfo(self, request: data_pb2.GetInfoRequest, context: grpc.ServicerContext) -> data_pb2.GetInfoResponse:
        host = self.manager.host
        return data_pb2.GetInfoResponse(
            node=self.manager.node, arena_path=str(host.path), arena_bytes=host.arena_bytes, arena_token=host.token,
            tiers=list(self.config.tiers), max_pages_per_request=self.config.max_pages_per_request,
            max_page_bytes=self.config.max_page_bytes,
        )

    @unary
    def Allocate(self, request: data_pb2.AllocateRequest, context: grpc.ServicerContext) -> data_pb2.AllocateResponse:
        ns = validate.namespace_id(request.namespace_id)
        layout = validate.layout(request.layout)
        ident, slots = self.manager.allocate(ns, layout, self._keys(list(request.keys)))
        return data_pb2.AllocateResponse(
            allocation_id=ident, page_bytes=layout.page_bytes,
            slots=[data_pb2.Slot(key=k, offset=o or 0, exists=o is None) for k, o in slots],
        )

    @unary
    def Commit(self, request: data_pb2.CommitRequest, context: grpc.ServicerContext) -> data_pb2.CommitResponse:
        keys = validate.keys(list(request.keys), self.config.max_pages_per_request, allow_empty=True)
        n = self.manager.commit(request.allocation_id, keys, list(request.checksums), request.durable, request.flags)
        return data_pb2.CommitResponse(num_published=n)

    @unary
    def Abort(self, request: data_pb2.AbortRequest, context: grpc.ServicerContext) -> data_pb2.AbortResponse:
        self.manager.abort(request.allocation_id)
        return data_pb2.AbortResponse()

    @unary
    def Acquire(self, request: data_pb2.AcquireRequest, context: grpc.ServicerContext) -> data_pb2.AcquireResponse:
        ns = validate.namespace_id(request.namespace_id)
        ident, pages = self.manager.acquire(ns, self._keys(list(request.keys)), request.ttl_ms)
        page_bytes = self.manager.host.header(pages[0].key).payload_bytes if pages else 0  # type: ignore[union-attr]
        return data_pb2.AcquireResponse(
            lease_id=ident, page_bytes=page_bytes,
            pages=[data_pb2.AcquiredPage(key=p.key, offset=p.offset, checksum=p.checksum) for p in pages],
        )

    @unary
    def Release(self, request: data_pb2.ReleaseRequest, context: grpc.ServicerContext) -> data_pb2.ReleaseResponse:
        self.manager.release(request.lease_id)
        return data_pb2.ReleaseResponse()

    @unary
    def Renew(self, request: data_pb2.RenewRequest, context: grpc.ServicerContext) -> data_pb2.RenewResponse:
        self.manager.renew(request.lease_id, request.ttl_ms)
        return data_pb2.RenewResponse()

    @unary
    def WritePages(self, request_iterator: Iterator[WireChunk], context: grpc.ServicerContext) -> data_pb2.WritePagesResponse:
        """Each page takes the same allocate -> fill -> commit path as a same-host client's,
        the server filling the slot from the stream and checking the checksum as the bytes
        pass (a page stored already is only checked)."""
        stored = 0
        page: _IncomingPage | None = None
        try:
            for chunk in request_iterator:
                if chunk.error:
                    raise InvalidRequest(f"WritePages: {chunk.error}")
                if page is None or chunk.offset == 0:
                    if page is not None:
                        raise page.truncated()
                    page = self._start_page(chunk)
                if page.add(chunk):
                    done, page = page, None
                    if not self.manager.commit(done.allocation_id, [done.key], [done.checksum], done.durable, done.flags):
                        break  # stored at its first chunk, gone at its commit: num_published ends here
                    stored += 1
            if page is not None:
                raise page.truncated()
        finally:
            if page is not None:
                self.manager.abort(page.allocation_id)
        return data_pb2.WritePagesResponse(num_published=stored)

    def _start_page(self, chunk: WireChunk) -> _IncomingPage:
        """Checks a page's first chunk and allocates the host slot its bytes go to."""
        key = validate.keys([chunk.key], 1)[0]
        ns = validate.namespace_id(chunk.namespace_id)
        layout = validate.layout(chunk.layout)
        if chunk.page_bytes != layout.page_bytes:
            raise InvalidRequest(f"page_bytes {chunk.page_bytes} does not match the layout ({layout.page_bytes})")
        if chunk.offset != 0:
            raise InvalidRequest("the first chunk of a page must have offset 0")
        allocation_id, [(_, offset)] = self.manager.allocate(ns, layout, [key])
        dest = None if offset is None else self.manager.host.view(offset, layout.page_bytes)
        return _IncomingPage(key, chunk.page_bytes, chunk.checksum, chunk.durable, chunk.flags, allocation_id, dest)

    @unary
    def Hint(self, request: data_pb2.HintRequest, context: grpc.ServicerContext) -> data_pb2.HintResponse:
        ns = validate.namespace_id(request.namespace_id)
        if len(request.entries) > self.config.max_pages_per_request:
            raise InvalidRequest(f"too many hint entries: {len(request.entries)}")
        max_eta_ms = int(self.config.max_hint_eta_s * 1000)
        entries = []  # every entry is checked before any is applied
        for i, entry in enumerate(request.entries):
            if entry.eta_ms > max_eta_ms:
                raise InvalidRequest(f"entries[{i}].eta_ms {entry.eta_ms} is beyond the maximum of {max_eta_ms} ms (--max-hint-eta-s)")
            entries.append((self._keys(list(entry.keys)), entry.eta_ms / 1000))
        return data_pb2.HintResponse(reserved=[self.manager.hint(ns, keys, eta_s) for keys, eta_s in entries])

    @unary
    def AppendTokens(self, request: data_pb2.AppendTokensRequest, context: grpc.ServicerContext) -> data_pb2.AppendTokensResponse:
        ns = validate.namespace_id(request.namespace_id)
        if len(request.tokens) > 1 << 20:
            raise InvalidRequest(f"too many tokens in one append: {len(request.tokens)}")
        length = self.wal.append(ns, request.session_id, request.expected_length, list(request.tokens),
                                 request.prompt_tokens, request.sync)
        return data_pb2.AppendTokensResponse(length=length)

    @unary
    def GetSession(self, request: data_pb2.GetSessionRequest, context: grpc.ServicerContext) -> data_pb2.GetSessionResponse:
        found = self.wal.read(validate.namespace_id(request.namespace_id), request.session_id)
        if found is None:
            return data_pb2.GetSessionResponse(found=False)
        return data_pb2.GetSessionResponse(found=True, prompt_tokens=found[0], tokens=found[1])

    @unary
    def EndSession(self, request: data_pb2.EndSessionRequest, context: grpc.ServicerContext) -> data_pb2.EndSessionResponse:
        self.wal.end(validate.namespace_id(request.namespace_id), request.session_id)
        return data_pb2.EndSessionResponse()

    @stream
    def ReadPages(self, request: data_pb2.ReadPagesRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        ns = validate.namespace_id(request.namespace_id)
        keys = self._keys(list(request.keys))
        chunk_bytes = request.chunk_bytes or CHUNK_BYTES
        check_chunk_bytes(chunk_bytes)
        ident, pages = self.manager.acquire(ns, keys, request.ttl_ms)
        try:
            for page in pages:
                header, view = self.manager.read_view(page.key)
                yield from page_chunks(header.key, header.namespace_id, validate.layout_msg(header.layout), view,
                                       header.checksum, chunk_bytes=chunk_bytes)
        finally:
            self.manager.release(ident)
