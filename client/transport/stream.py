"""Pages over gRPC streams (WritePages / ReadPages): works from any host.

The runtime loop only sends and receives; one wire thread encodes (or decodes, verifies
and places) the chunks of one page while the loop moves those of the next, in stream
order. From a CPU tensor chunks are built straight from its rows and received chunks go
straight into them: one copy each way.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import torch

from kvstore._proto import data_pb2
from kvstore.client.engine_kv import EngineKV
from kvstore.client.hit import missing, partial, published_prefix
from kvstore.client.page_assembler import PageAssembler
from kvstore.client.pages import RowPage, page_rows, slot_as_page
from kvstore.client.transport.contract import NamespaceServer, page_in, page_out
from kvstore.errors import KVStoreError, PageCorrupt, TierFull
from kvstore.page import checksum
from kvstore.page_wire.grpc_chunks import announced, decode_chunk, page_chunks

logger = logging.getLogger(__name__)


class StreamTransport:
    """The gRPC stream path (see kvstore.client.transport.contract.Transport for the contract)."""

    def __init__(self, peer: NamespaceServer, chunk_bytes: int) -> None:
        self.peer = peer
        self.layout = peer.layout
        self.chunk_bytes = chunk_bytes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-wire")  # chunks in stream order
        self._buf: torch.Tensor | None = None  # one page, used on the kv-wire thread only

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- the two RPCs ----------------------------------------------------------------------

    async def write_pages(self, keys: list[bytes], encode: Callable[[int], list[bytes]]) -> int:
        """One WritePages stream of ``keys``; ``encode(i)`` (on the wire thread, one page
        ahead of the send) gives page i's chunks. Returns the server's num_published."""
        loop = asyncio.get_running_loop()

        async def chunks() -> Any:
            ahead = loop.run_in_executor(self._pool, encode, 0)
            for i in range(len(keys)):
                current = await ahead
                if i + 1 < len(keys):
                    ahead = loop.run_in_executor(self._pool, encode, i + 1)
                for chunk in current:
                    yield chunk

        runtime = self.peer.runtime
        return int((await runtime.rpc(runtime.pages.write_pages, chunks())).num_published)

    async def read_pages(self, keys: list[bytes], pages: PageAssembler, on_page: Callable[[], None] | None = None,
                         timeout_s: float | None = None) -> None:
        """One ReadPages stream of ``keys`` fed to ``pages`` on the wire thread (``on_page``
        after each page completes there). ``pages.count`` says how far it got; raises
        PageCorrupt (from the assembler) or the mapped gRPC error. No placement runs and no
        unverified byte is left once this returns. The server sends the pages unchecked: the
        assembler checks each one as it lands (DESIGN §4: one hash, where the bytes are
        consumed); a page that fails it is read again alone, checked, so that a copy damaged at
        the server is quarantined there (``_have_checked``)."""
        loop = asyncio.get_running_loop()
        runtime = self.peer.runtime
        req = data_pb2.ReadPagesRequest(namespace_id=self.peer.namespace_id, keys=keys, ttl_ms=self.peer.lease_ms,
                                        chunk_bytes=self.chunk_bytes, unchecked=True)

        def place(raw: bytes) -> None:
            if pages.feed(decode_chunk(raw)) and on_page is not None:
                on_page()

        previous: asyncio.Future[None] | None = None
        placing: asyncio.Future[None] | None = None
        budget_s = timeout_s or runtime.timeout_s
        ends = loop.time() + budget_s  # the re-read of a failed page takes what is left of it, not a budget of its own
        call = runtime.pages.read_pages(req, timeout=budget_s)
        try:
            async for raw in call:
                previous, placing = placing, loop.run_in_executor(self._pool, place, raw)
                if previous is not None:
                    await asyncio.shield(previous)
            if placing is not None:
                await asyncio.shield(placing)
        except grpc.aio.AioRpcError as exc:
            raise runtime.error(exc) from None
        except PageCorrupt:
            call.cancel()  # the server's lease, pins and stream slot go now, not at its idle watchdog
            await asyncio.gather(*(f for f in (previous, placing) if f is not None), return_exceptions=True)
            if pages.count < len(keys):
                await self._have_checked(keys[pages.count], max(0.05, ends - loop.time()))
            raise
        finally:  # never leave the call open nor the wire thread writing after returning (also when cancelled)
            call.cancel()
            await asyncio.gather(*(f for f in (previous, placing) if f is not None), return_exceptions=True)
            pages.abandon()  # a stream cut mid-page leaves no unverified bytes behind

    async def _have_checked(self, key: bytes, timeout_s: float) -> None:
        """Reads ``key`` again alone, checked: the server's send hashes it first and quarantines
        it if its bytes fail (what it sent did not pass this reader's check). The bytes are not
        kept; the page is a miss either way (the caller recomputes from it)."""
        runtime = self.peer.runtime
        req = data_pb2.ReadPagesRequest(namespace_id=self.peer.namespace_id, keys=[key], ttl_ms=self.peer.lease_ms,
                                        chunk_bytes=self.chunk_bytes)
        try:
            async for _ in runtime.pages.read_pages(req, timeout=timeout_s):
                pass
        except grpc.aio.AioRpcError as exc:
            logger.warning("page %s failed its check; asking the server to check its copy failed: %s", key.hex(), exc.details())

    # -- put / get -------------------------------------------------------------------------

    async def put(self, keys: list[bytes], kv: torch.Tensor | EngineKV, durable: bool, flags: int,
                  generation: int | None = None, session_id: str = "") -> int:
        """One WritePages stream per ``max_pages`` pages, until one comes back short."""
        stored = 0
        while stored < len(keys):
            batch = keys[stored : stored + self.peer.max_pages]
            try:
                parent = keys[stored - 1] if stored else b""  # the server links each page to the one before it
                n = await self.write_pages(batch, self._encoder(batch, kv, stored, durable, flags, parent, generation,
                                                                session_id))
            except TierFull:
                if stored == 0:
                    raise
                logger.warning("tier full after %d of %d pages; the rest is not stored", stored, len(keys))
                break
            stored += published_prefix(len(batch), n, durable, stored, self.layout.page_tokens)
            if n < len(batch):
                break  # a page stored at the start of the stream was gone at its commit
        return stored

    def _encoder(self, keys: list[bytes], kv: torch.Tensor | EngineKV, first_page: int, durable: bool,
                 flags: int, parent: bytes = b"", generation: int | None = None,
                 session_id: str = "") -> Callable[[int], list[bytes]]:
        rows = page_rows(kv, self.layout)

        def encode(i: int) -> list[bytes]:
            page = rows.page(first_page + i) if rows is not None else self._buffered(kv, first_page + i)
            return self.encode_page(keys[i], page, None, durable, flags, parent if i == 0 else b"", generation, session_id,
                                    announced(keys, i))

        return encode

    def _buffered(self, kv: torch.Tensor | EngineKV, page: int) -> torch.Tensor:
        """One page of the engine's KV as contiguous bytes, in a buffer reused by the wire
        thread (fresh memory is slow to touch; the encoded chunks copy out of it)."""
        if self._buf is None:
            self._buf = torch.empty(self.layout.page_shape(), dtype=self.layout.torch_dtype())
        page_in(self._buf, kv, page, self.layout)
        return self._buf.view(torch.uint8).reshape(-1)

    def encode_page(self, key: bytes, page: Any, csum: int | None, durable: bool, flags: int = 0,
                    parent: bytes = b"", generation: int | None = None, session_id: str = "",
                    next_keys: Sequence[bytes] = ()) -> list[bytes]:
        """The WritePages chunks of one page: ``page`` is contiguous bytes or a RowPage of the
        engine's tensor (copied once, into the chunks); ``csum`` None: computed here;
        ``parent``: the page before it in its prefix; ``session_id``: the session it is saved for;
        ``next_keys``: the keys after it the stream announces (the server commits them in groups)."""
        data = page if isinstance(page, RowPage) else memoryview(page.numpy())
        return list(page_chunks(key, self.peer.namespace_id, self.peer.layout_msg, data, csum, durable, self.chunk_bytes,
                                flags, parent, generation, session_id, next_keys))

    async def get(self, keys: list[bytes], into: torch.Tensor | EngineKV) -> None:
        """One ReadPages stream per ``max_pages`` pages; a stream that delivers nothing means
        the next page is gone."""
        done = 0
        while done < len(keys):
            n = await self._read_into(keys[done : done + self.peer.max_pages], into, done)
            if n == 0:
                raise missing(len(keys), done, self.layout.page_tokens)
            done += n

    async def _read_into(self, keys: list[bytes], into: torch.Tensor | EngineKV, first_page: int) -> int:
        rows = page_rows(into, self.layout)
        on_page: Callable[[], None] | None = None
        if rows is not None:  # chunks go straight into the engine's tensor
            pages = PageAssembler(keys, self.layout.page_bytes, target=lambda index: rows.page(first_page + index))
        else:
            pages = PageAssembler(keys, self.layout.page_bytes)

            def on_page() -> None:
                page_out(into, first_page + pages.count - 1, slot_as_page(pages.page, self.layout), self.layout)
        try:
            await self.read_pages(keys, pages, on_page)
        except PageCorrupt as exc:
            valid = (first_page + pages.count) * self.layout.page_tokens
            raise partial(PageCorrupt, f"{exc} (stream from page {first_page}); {valid} tokens are valid, "
                          "recompute the rest", valid) from None
        return pages.count

    # -- layer-wise ------------------------------------------------------------------------

    def staged(self, on_device: bool = False) -> StreamedPages:
        """Streamed pages land in host buffers whatever ``on_device`` says (no pool is mapped off the server's host)."""
        return StreamedPages(self)

    def outgoing(self, session_id: str = "", generation: int | None = None) -> StreamedOutgoing:
        return StreamedOutgoing(self, session_id, generation)


class StreamedPages:
    """A layer-wise load's pages, streamed into buffers of their own and verified on arrival
    (nothing is held on the server: renew and release have nothing to do)."""

    def __init__(self, transport: StreamTransport) -> None:
        self.transport = transport
        self.pages: list[torch.Tensor] = []
        self.checksums: list[int] = []

    async def fill(self, keys: list[bytes], timeout_s: float) -> None:
        """Stops at the first missing or bad page, or where ``timeout_s`` cuts the stream;
        raises when the stream failed before its first page."""
        pages = PageAssembler(keys, self.transport.layout.page_bytes, reuse=False)

        def keep() -> None:  # on the wire thread, off the runtime loop
            self.checksums.append(checksum(pages.page.numpy()))
            self.pages.append(pages.page)

        try:
            await self.transport.read_pages(keys, pages, keep, timeout_s)
        except PageCorrupt as exc:
            logger.warning("page stream ended after %d of %d pages: %s", len(self.pages), len(keys), exc)
        except KVStoreError as exc:
            if not self.pages:
                raise
            logger.warning("page stream ended after %d of %d pages: %s", len(self.pages), len(keys), exc)

    def verify(self) -> int:
        return len(self.pages)

    async def renew(self, timeout_s: float) -> None:
        return None

    async def release(self) -> None:
        return None


class StreamedOutgoing:
    """A layer-wise save's pages, collected in buffers of their own and sent in one
    WritePages stream at publish (nothing is reserved on the server before)."""

    def __init__(self, transport: StreamTransport, session_id: str = "", generation: int | None = None) -> None:
        self.transport = transport
        self.session_id = session_id  # named in each page's first chunk: refused once the session is fenced
        self.generation = generation  # named likewise: refused once an invalidation raised it (DESIGN §3)
        self.keys: list[bytes] = []
        self.parent = b""
        self.buffers: list[torch.Tensor] = []
        self.indices: list[int] = []
        self.asked = 0

    async def reserve(self, keys: list[bytes], parent: bytes = b"") -> None:
        self.keys, self.parent = keys, parent
        self.indices = list(range(len(keys)))
        self.buffers = [torch.empty(self.transport.layout.page_bytes, dtype=torch.uint8) for _ in keys]
        self.asked = len(keys)

    async def publish(self, checksums: list[int], durable: bool) -> int:
        keys, buffers = self.keys, self.buffers
        return await self.transport.write_pages(
            keys, lambda i: self.transport.encode_page(keys[i], buffers[i], checksums[i], durable, 0, b"" if i else self.parent,
                                                       self.generation, self.session_id, announced(keys, i)))

    term_s = math.inf  # nothing is reserved on the server

    async def renew(self, timeout_s: float) -> None:
        return None

    async def written(self, layers: int, timeout_s: float) -> None:
        return None  # the bytes stay here until publish

    async def discard(self) -> None:
        return None
