"""KVStoreClient: store the KV an engine computed, find the longest stored prefix, fetch it.

Contract:
* Only full pages are stored; ``put`` returns how many leading tokens are now stored.
* ``lookup`` answers the longest contiguous stored prefix (page-aligned) in one RPC per
  ``max_pages_per_request`` pages.
* ``get`` delivers exactly the pages of the hit, each verified against its checksum, or
  raises (PageMissing / PageCorrupt) after copying the valid leading pages; the exception's
  ``num_tokens`` says how many leading tokens of ``into`` are valid.
* Every RPC has a deadline: no call hangs.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

import grpc
import torch

from kvstore._proto import data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.client.arena import ArenaMap
from kvstore.client.engine_kv import EngineKV, as_engine_kv
from kvstore.client.layerwise import LayerLoad, LayerSave
from kvstore.client.pages import KVRows, RowPage, check_kv, copy_bytes, page_of, page_rows, slot_as_page
from kvstore.client.session import Recovery, SessionLog
from kvstore.client.session import recover as recover_session
from kvstore.client.wire import PageAssembler
from kvstore.errors import InvalidRequest, KVStoreError, PageCorrupt, PageMissing, TierFull
from kvstore.keys import page_keys
from kvstore.page import FLAG_SESSION_OPEN, FLAG_WANTED, LayoutDesc, checksum
from kvstore.pagecopy import copy_checksum
from kvstore.status import ERROR_METADATA_KEY, error_for
from kvstore.types import Location, LocationRun, Namespace
from kvstore.validate import layout_msg
from kvstore.wire import CHUNK_BYTES, PageStubs, check_chunk_bytes, decode_chunk, page_chunks
from kvstore.wire import MESSAGE_OPTIONS as CHANNEL_OPTIONS

logger = logging.getLogger(__name__)

T = TypeVar("T")
PIPELINE_PAGES = 64
RAMP_PAGES = 8  # the first batch of a transfer; each next one doubles up to the full batch


def _error_name(exc: Any) -> str | None:
    """The server's error class name from trailing metadata, if it sent one."""
    try:
        for key, value in exc.trailing_metadata() or ():
            if key == ERROR_METADATA_KEY:
                return str(value)
    except Exception:  # noqa: BLE001 - a transport failure carries no metadata
        return None
    return None


@dataclass(frozen=True)
class Hit:
    """The stored prefix of a token sequence: ``num_tokens`` leading tokens (whole pages)."""

    namespace_id: bytes
    num_tokens: int
    keys: list[bytes] = field(repr=False)
    runs: list[LocationRun] = field(repr=False)  # where the pages are, run-length encoded, in order

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def locations(self) -> list[Location]:
        """One location per page (expanded from ``runs``)."""
        return [Location(r.node, r.tier, 0, r.size_bytes) for r in self.runs for _ in range(r.num_pages)]


def _partial(cls: type[KVStoreError], message: str, num_tokens: int) -> KVStoreError:
    exc = cls(message)
    exc.num_tokens = num_tokens  # type: ignore[attr-defined]
    return exc


class KVStoreClient:
    """One namespace's view of a kvstore server. Use as ``async with``."""

    def __init__(
        self,
        address: str,
        namespace: Namespace,
        *,
        use_shm: bool = True,
        timeout_s: float = 30.0,
        lease_ms: int = 30_000,
        copy_threads: int = 2,
        prefill_tokens_per_s: float = 3000.0,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        """``chunk_bytes``: the most page bytes one gRPC message carries on the socket path
        (4 KiB to 8 MiB); by default a page up to 4 MiB is one message."""
        check_chunk_bytes(chunk_bytes)
        self.chunk_bytes = chunk_bytes
        self.address = address
        self.namespace = namespace
        self.layout = namespace.layout
        self.use_shm = use_shm
        self.timeout_s = timeout_s
        self.lease_ms = lease_ms
        self._layout_desc = LayoutDesc.of(self.layout)
        self._layout_msg = layout_msg(self._layout_desc)
        self._pool = ThreadPoolExecutor(max_workers=copy_threads, thread_name_prefix="kv-copy")
        # One thread for socket pages: chunks are encoded and placed in stream order.
        self._wire_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-wire")
        self._wire_buf: torch.Tensor | None = None  # one page, used on the kv-wire thread only
        self._copy_threads = copy_threads
        self._channel: grpc.aio.Channel | None = None
        self.arena: ArenaMap | None = None
        self.max_pages = 4096
        self._arena_bytes = 0
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.load_bps = 0.0  # measured by layer-wise loads (EWMA)
        self._sync_channel: grpc.Channel | None = None
        self._handles: weakref.WeakSet[Any] = weakref.WeakSet()  # running layer-wise loads/saves

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._directory = directory_pb2_grpc.DirectoryStub(self._channel)
        self._data = data_pb2_grpc.DataStub(self._channel)
        self._pages = PageStubs(self._channel)
        info = await self._call(self._data.GetInfo, data_pb2.GetInfoRequest())
        self.node = info.node
        self.max_pages = max(1, info.max_pages_per_request)
        self._arena_bytes = info.arena_bytes
        if self.use_shm:
            self.arena = ArenaMap.open(info.arena_path, info.arena_bytes, info.arena_token)

    async def close(self) -> None:
        for handle in list(self._handles):
            handle.abandon("client closed")
        for handle in list(self._handles):
            await asyncio.get_running_loop().run_in_executor(None, handle.join, self.timeout_s)
        if self._sync_channel is not None:
            self._sync_channel.close()
            self._sync_channel = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self._pool.shutdown(wait=True)
        self._wire_pool.shutdown(wait=True)

    @property
    def shared_memory(self) -> bool:
        """True when page bytes move through the shared arena rather than the socket."""
        return self.arena is not None

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

    def _error(self, exc: Any) -> KVStoreError:
        name = _error_name(exc)
        if name is None and exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return KVStoreError(f"kvstore-server at {self.address}: {exc.code().name}: {exc.details()}")
        return error_for(exc.code(), exc.details() or "", name)

    def _batches(self, items: list[T]) -> list[list[T]]:
        return [items[i : i + self.max_pages] for i in range(0, len(items), self.max_pages)]

    def keys(self, tokens: Any) -> list[bytes]:
        """The page keys of ``tokens`` (full pages only)."""
        return page_keys(self.namespace.namespace_id, tokens, self.layout.page_tokens)

    # -- lookup --------------------------------------------------------------------------

    async def lookup(self, tokens: Any) -> Hit:
        """The longest stored prefix of ``tokens``."""
        keys = self.keys(tokens)
        runs: list[LocationRun] = []
        n = 0
        for batch in self._batches(keys):
            resp = await self._call(self._directory.Lookup, directory_pb2.LookupRequest(namespace_id=self.namespace.namespace_id, keys=batch))
            runs.extend(LocationRun(r.node, r.tier, r.num_pages, r.size_bytes) for r in resp.runs)
            n += resp.num_pages
            if resp.num_pages < len(batch):
                break
        return Hit(self.namespace.namespace_id, n * self.layout.page_tokens, keys[:n], runs)

    # -- put -----------------------------------------------------------------------------

    async def put(self, tokens: Any, kv: torch.Tensor | EngineKV, *, durable: bool = False, wanted: bool = False,
                  session_open: bool = False) -> int:
        """Stores the full pages of ``kv`` (``[layers, kv, tokens, heads, dim]``).

        Pages already stored are not written again. With ``durable`` every page of the
        returned prefix, those stored before in RAM included, is on the ssd tier (synced)
        when this returns, or this raises (TierFull, TierUnavailable, or PageMissing with
        ``num_tokens`` durable). ``wanted`` / ``session_open`` tell SSD admission these pages
        will be used again. Returns the number of leading tokens stored.
        """
        flags = (FLAG_WANTED if wanted else 0) | (FLAG_SESSION_OPEN if session_open else 0)
        keys = self.keys(tokens)
        self._check(kv, len(keys) * self.layout.page_tokens, "kv")
        if self.arena is not None:
            stored = await self._put_shm_pipelined(keys, kv, durable, flags)
        else:
            stored = 0
            while stored < len(keys):
                try:
                    n = await self._put_wire(keys[stored : stored + self.max_pages], kv, stored, durable, flags)
                except TierFull:
                    if stored == 0:
                        raise
                    logger.warning("tier full after %d of %d pages; the rest is not stored", stored, len(keys))
                    break
                asked = min(len(keys) - stored, self.max_pages)
                stored += self.published_prefix(asked, n, durable, stored)
                if n < asked:
                    break  # a page stored at the start of the stream was gone at its commit
        return stored * self.layout.page_tokens

    def _batch_pages(self) -> int:
        """Pages per Allocate/Acquire: small enough that copying one batch overlaps the
        server's work on others, and at most a sixth of the arena so that the batches in
        flight (one allocated ahead, two being copied, up to three committing) always fit."""
        arena_pages = self._arena_bytes // max(1, self.layout.page_bytes)
        return max(1, min(self.max_pages, arena_pages // 6, PIPELINE_PAGES))

    def _batch_sizes(self) -> Iterator[int]:
        """The batch sizes of one transfer: from RAMP_PAGES, doubling up to ``_batch_pages``,
        so that the other side starts working after a short first batch."""
        full = self._batch_pages()
        size = min(full, RAMP_PAGES)
        while True:
            yield size
            size = min(full, size * 2)

    async def _put_shm_pipelined(self, keys: list[bytes], kv: torch.Tensor | EngineKV, durable: bool, flags: int = 0) -> int:
        """Allocate, copy, commit batch by batch, overlapped: two batches are queued on the
        copy threads (so they never wait between batches), the next one is being allocated
        and up to two earlier ones commit (and, when durable, are written to ssd).
        Returns pages stored (a prefix)."""
        rows = page_rows(kv, self.layout)
        stored = cursor = 0
        copying: deque[tuple[Any, list[Any], asyncio.Future[list[Any]]]] = deque()
        commits: deque[tuple[int, asyncio.Future[Any]]] = deque()  # (pages asked, the Commit answer)
        short = False  # a commit came back short: the stored prefix ended there
        ahead: asyncio.Future[Any] | None = None

        sizes = self._batch_sizes()

        def allocate(start: int) -> asyncio.Future[Any]:
            return asyncio.ensure_future(self._call(self._data.Allocate, data_pb2.AllocateRequest(
                namespace_id=self.namespace.namespace_id, layout=self._layout_msg, keys=keys[start : start + next(sizes)])))

        async def commit_oldest() -> None:
            alloc, todo, copied = copying[0]
            sums = await copied
            copying.popleft()
            commits.append((len(alloc.slots), asyncio.ensure_future(self._call(self._data.Commit, data_pb2.CommitRequest(
                allocation_id=alloc.allocation_id, keys=[slot.key for _, slot in todo], checksums=sums, durable=durable,
                flags=flags)))))

        async def settle_oldest() -> None:
            nonlocal stored, short
            asked, answer = commits.popleft()
            n = self.published_prefix(asked, (await answer).num_published, durable, stored)
            if not short:
                stored += n
            short = short or n < asked

        try:
            ahead = allocate(0)
            while ahead is not None or copying:
                if ahead is None or len(copying) >= 2:
                    await commit_oldest()
                    if len(commits) > 2:
                        await settle_oldest()
                    continue
                try:
                    alloc = await ahead
                except TierFull:
                    ahead = None
                    if copying or commits:  # their pages become evictable once committed
                        while copying:
                            await commit_oldest()
                        while commits:
                            await settle_oldest()
                        ahead = allocate(cursor)
                        continue
                    if cursor == 0:
                        raise
                    logger.warning("tier full after %d of %d pages; the rest is not stored", cursor, len(keys))
                    break
                n = len(alloc.slots)
                todo = [(i, slot) for i, slot in enumerate(alloc.slots) if not slot.exists]
                copying.append((alloc, todo, self._submit(
                    lambda item, base=cursor: self._write_slot(kv, rows, base + item[0], item[1].offset), todo)))
                cursor += n
                ahead = allocate(cursor) if cursor < len(keys) else None
            while commits:
                await settle_oldest()
        finally:
            # An error ended the loop: let the copies finish (they write into the slots),
            # then give back every allocation not committed.
            unused = [alloc for alloc, _, _ in copying]
            await asyncio.gather(*(copied for _, _, copied in copying), return_exceptions=True)
            if ahead is not None:
                try:
                    unused.append(await ahead)
                except KVStoreError:
                    pass
            for alloc in unused:
                try:
                    await self._call(self._data.Abort, data_pb2.AbortRequest(allocation_id=alloc.allocation_id))
                except KVStoreError:
                    pass
            if commits:
                await asyncio.gather(*(answer for _, answer in commits), return_exceptions=True)
        return stored

    def published_prefix(self, asked: int, num_published: int, durable: bool, first_page: int) -> int:
        """The pages of a commit's ``asked`` that the server reports stored (a prefix). A
        durable write that comes back short raises: the pages after it are not on ssd."""
        n = min(asked, num_published)
        if durable and n < asked:
            done = (first_page + n) * self.layout.page_tokens
            raise _partial(PageMissing, f"durable write: page {first_page + n} was removed before its commit, so it is "
                           f"not on ssd; {done} leading tokens are durable", done)
        return n

    def _check(self, kv: torch.Tensor | EngineKV, tokens: int, name: str) -> None:
        if isinstance(kv, torch.Tensor):
            check_kv(kv, self.layout, tokens, name)
        elif kv.num_tokens < tokens:
            raise InvalidRequest(f"{name} holds {kv.num_tokens} tokens, {tokens} are needed")

    def _page_in(self, dst: torch.Tensor, kv: torch.Tensor | EngineKV, page: int) -> None:
        """dst (one page, layer-major) <- page ``page`` of the engine's KV."""
        if isinstance(kv, torch.Tensor):
            copy_bytes(dst, page_of(kv, page, self.layout.page_tokens))
        else:
            for layer in range(self.layout.num_layers):
                dst[layer].copy_(kv.read_layer(page, layer))

    def _page_out(self, into: torch.Tensor | EngineKV, page: int, src: torch.Tensor) -> None:
        """Page ``page`` of the engine's KV <- src (one page, layer-major)."""
        if isinstance(into, torch.Tensor):
            copy_bytes(page_of(into, page, self.layout.page_tokens), src)
        else:
            for layer in range(self.layout.num_layers):
                into.write_layer(page, layer, src[layer])

    def _write_slot(self, kv: torch.Tensor | EngineKV, rows: KVRows | None, page: int, offset: int) -> int:
        """Copies page ``page`` of the engine's KV into the arena slot at ``offset`` and
        returns its checksum. From a CPU tensor it is one strided numpy copy of the rows."""
        assert self.arena is not None
        n = self.layout.page_bytes
        slot = self.arena.array[offset : offset + n]
        if rows is not None:
            return copy_checksum(slot.reshape(rows.rows.shape[0], -1), rows.page(page).rows)
        self._page_in(slot_as_page(self.arena.slot(offset, n), self.layout), kv, page)
        return checksum(slot)

    def _submit(self, fn: Any, items: list[Any]) -> asyncio.Future[list[Any]]:
        """fn over items on the copy threads, in order; contiguous shares per thread. Not
        awaited here, so that callers can queue the next batch behind this one."""
        loop = asyncio.get_running_loop()
        share = max(1, -(-len(items) // self._copy_threads))
        parts = [items[i : i + share] for i in range(0, len(items), share)]
        futures = [loop.run_in_executor(self._pool, lambda p=p: [fn(x) for x in p]) for p in parts]

        async def joined() -> list[Any]:
            results = await asyncio.gather(*futures, return_exceptions=True)  # all shares end before this does
            for part in results:
                if isinstance(part, BaseException):
                    raise part
            return [r for part in results for r in part]  # type: ignore[union-attr]

        return asyncio.ensure_future(joined())

    def _wire_page(self, kv: torch.Tensor | EngineKV, page: int) -> torch.Tensor:
        """One page of the engine's KV as contiguous bytes, in a buffer reused by the kv-wire
        thread (fresh memory is slow to touch; the encoded chunks copy out of it)."""
        if self._wire_buf is None:
            self._wire_buf = torch.empty(self.layout.page_shape(), dtype=self.layout.torch_dtype())
        self._page_in(self._wire_buf, kv, page)
        return self._wire_buf.view(torch.uint8).reshape(-1)

    def _encode_page(self, key: bytes, page: Any, csum: int | None, durable: bool, flags: int = 0) -> list[bytes]:
        """The encoded WritePages chunks of one page (runs on a copy thread): ``page`` is
        contiguous bytes or a RowPage of the engine's tensor (copied once, into the chunks)."""
        data = page if isinstance(page, RowPage) else memoryview(page.numpy())
        return list(page_chunks(key, self.namespace.namespace_id, self._layout_msg, data, csum, durable, self.chunk_bytes, flags))

    async def _put_wire(self, keys: list[bytes], kv: torch.Tensor | EngineKV, first_page: int, durable: bool,
                        flags: int = 0) -> int:
        """One WritePages stream; page i+1 is encoded on a worker thread while the event
        loop sends page i. From a CPU tensor the chunks are built straight from its rows."""
        loop = asyncio.get_running_loop()
        rows = page_rows(kv, self.layout)

        def encode(i: int) -> list[bytes]:
            page = rows.page(first_page + i) if rows is not None else self._wire_page(kv, first_page + i)
            return self._encode_page(keys[i], page, None, durable, flags)

        async def chunks() -> Any:
            ahead = loop.run_in_executor(self._wire_pool, encode, 0)
            for i in range(len(keys)):
                current = await ahead
                if i + 1 < len(keys):
                    ahead = loop.run_in_executor(self._wire_pool, encode, i + 1)
                for chunk in current:
                    yield chunk

        resp = await self._call(self._pages.write_pages, chunks())
        return int(resp.num_published)

    # -- get -----------------------------------------------------------------------------

    async def get(self, hit: Hit, into: torch.Tensor | EngineKV) -> int:
        """Copies the hit's pages into ``into`` (``[layers, kv, >= hit.num_tokens, heads, dim]``).

        Returns ``hit.num_tokens``. Raises PageMissing or PageCorrupt when a promised page
        cannot be delivered; the leading pages before it are in place (``exc.num_tokens``).
        """
        if hit.namespace_id != self.namespace.namespace_id:
            raise InvalidRequest("the hit belongs to another namespace than this client")
        self._check(into, hit.num_tokens, "into")
        if self.arena is not None:
            await self._get_shm_pipelined(hit, into)
            return hit.num_tokens
        done = 0
        while done < hit.num_pages:
            n = await self._get_wire(hit.keys[done : done + self.max_pages], into, done)
            if n == 0:
                raise self._missing(hit, done)
            done += n
        return hit.num_tokens

    def _missing(self, hit: Hit, done: int) -> KVStoreError:
        return _partial(
            PageMissing,
            f"lookup promised {hit.num_pages} pages but page {done} is no longer stored; "
            f"{done * self.layout.page_tokens} tokens are valid, recompute the rest",
            done * self.layout.page_tokens,
        )

    async def _get_shm_pipelined(self, hit: Hit, into: torch.Tensor | EngineKV) -> None:
        """Two acquires in flight (the server may be reading them from ssd: while it answers
        one it already works on the next) while two batches are queued on the copy threads;
        each lease is released as soon as its copy is done.

        The second acquire asks for the range after the first as if the first came back
        whole; when one comes back short (the host tier could not take more promoted pages)
        the ones issued after it are stale: they are released unused and asked again from
        where the short one ended. When the tier is full while our own leases hold space,
        the request waits for one of them to go and asks again; TierFull reaches the caller
        only when nothing of ours is held."""
        keys = hit.keys
        rows = page_rows(into, self.layout)
        sizes = self._batch_sizes()
        issued = 0  # the first page not yet asked for
        generation = 0  # bumped when a short answer makes the acquires in flight stale
        pending: deque[tuple[int, int, asyncio.Future[Any]]] = deque()  # (generation, pages asked, answer)

        def acquire() -> None:
            nonlocal issued
            size = min(next(sizes), len(keys) - issued)
            req = data_pb2.AcquireRequest(
                namespace_id=self.namespace.namespace_id, keys=keys[issued : issued + size], ttl_ms=self.lease_ms)
            pending.append((generation, size, asyncio.ensure_future(self._call(self._data.Acquire, req))))
            issued += size

        releases: list[asyncio.Future[Any]] = []

        def release(lease_id: bytes) -> None:
            releases.append(asyncio.ensure_future(self._call(self._data.Release, data_pb2.ReleaseRequest(lease_id=lease_id))))

        done = cursor = 0  # pages verified and in place / pages handed to the copy threads
        copying: deque[tuple[Any, asyncio.Future[list[bool]]]] = deque()
        missing = False
        held_back = False  # the host tier was full: ask again once one of our leases is gone
        try:
            while True:
                while not (missing or held_back) and len(pending) < 2 and issued < len(keys):
                    acquire()
                if not pending and not copying:
                    if held_back and not missing and issued < len(keys):
                        await asyncio.gather(*releases, return_exceptions=True)  # all ours are back
                        held_back = False
                        continue  # one more try: a second TierFull with nothing held raises
                    break
                if pending and len(copying) < 2:
                    gen, asked, answer = pending.popleft()
                    try:
                        acq = await answer
                    except TierFull:
                        if gen != generation or missing:
                            continue
                        if not copying and not pending:
                            raise  # nothing of ours holds the space: the tier is full of other leases
                        generation += 1  # our own leases hold it: retry when one is released
                        issued, held_back = cursor, True
                        continue
                    if gen != generation or missing:
                        release(acq.lease_id)  # stale, or past a missing page
                        continue
                    if not acq.pages:
                        release(acq.lease_id)
                        missing = True
                        continue  # the batches before it are still checked below
                    if len(acq.pages) < asked:
                        generation += 1
                        issued = cursor + len(acq.pages)
                    copying.append((acq, self._submit(
                        lambda item, base=cursor: self._read_slot(into, rows, base + item[0], item[1]),
                        list(enumerate(acq.pages)))))
                    cursor += len(acq.pages)
                    continue
                if not copying:  # only stale acquires left: let them come back and be released
                    continue
                acq, copied = copying[0]
                try:
                    ok = await copied
                finally:
                    copying.popleft()
                    release(acq.lease_id)
                if held_back:
                    await asyncio.gather(*releases, return_exceptions=True)  # the space is free before we ask again
                    held_back = False
                for i, good in enumerate(ok):
                    if not good:
                        raise _partial(
                            PageCorrupt, f"page {done + i} failed its checksum; "
                            f"{(done + i) * self.layout.page_tokens} tokens are valid, recompute the rest",
                            (done + i) * self.layout.page_tokens,
                        )
                done += len(ok)
            if missing or done < len(keys):
                raise self._missing(hit, done)
        finally:
            # An error ended the loop: let the copies finish before their leases go.
            for acq, copied in copying:
                await asyncio.gather(copied, return_exceptions=True)
                release(acq.lease_id)
            for _, _, answer in pending:
                try:
                    release((await answer).lease_id)
                except KVStoreError:
                    pass
            await asyncio.gather(*releases, return_exceptions=True)

    def _read_slot(self, into: torch.Tensor | EngineKV, rows: KVRows | None, page: int, acquired: Any) -> bool:
        """Copies the leased slot into page ``page`` of ``into`` and verifies it; False when
        the bytes fail their checksum, and then that page of ``into`` is zeroed: no byte of a
        corrupt page reaches the caller."""
        assert self.arena is not None
        n = self.layout.page_bytes
        slot = self.arena.array[acquired.offset : acquired.offset + n]
        if rows is not None:  # verified as it is copied (one pass); a bad page is wiped before anyone sees it
            dst = rows.page(page)
            if copy_checksum(dst.rows, slot.reshape(rows.rows.shape[0], -1)) == acquired.checksum:
                return True
            dst.clear()
            return False
        if checksum(slot) != acquired.checksum:
            return False
        self._page_out(into, page, slot_as_page(self.arena.slot(acquired.offset, n), self.layout))
        return True

    async def _get_wire(self, keys: list[bytes], into: torch.Tensor | EngineKV, first_page: int) -> int:
        """One ReadPages stream. The event loop only receives; a single worker thread decodes,
        verifies and places each chunk (in order) while the next one arrives."""
        loop = asyncio.get_running_loop()
        req = data_pb2.ReadPagesRequest(namespace_id=self.namespace.namespace_id, keys=keys, ttl_ms=self.lease_ms,
                                        chunk_bytes=self.chunk_bytes)
        rows = page_rows(into, self.layout)
        if rows is not None:  # chunks go straight into the engine's tensor
            pages = PageAssembler(keys, self.layout.page_bytes, target=lambda index: rows.page(first_page + index))

            def place(raw: bytes) -> None:
                pages.feed(decode_chunk(raw))
        else:
            pages = PageAssembler(keys, self.layout.page_bytes)

            def place(raw: bytes) -> None:
                if pages.feed(decode_chunk(raw)):
                    self._page_out(into, first_page + pages.count - 1, slot_as_page(pages.page, self.layout))

        placing: asyncio.Future[None] | None = None
        try:
            async for raw in self._pages.read_pages(req, timeout=self.timeout_s):
                previous, placing = placing, loop.run_in_executor(self._wire_pool, place, raw)
                if previous is not None:
                    await previous
            if placing is not None:
                await placing
                placing = None
        except PageCorrupt as exc:
            valid = first_page + pages.count
            raise _partial(PageCorrupt, f"{exc} (stream from page {first_page}); {valid * self.layout.page_tokens} "
                           "tokens are valid, recompute the rest", valid * self.layout.page_tokens) from None
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        finally:
            if placing is not None:  # never leave a worker writing into ``into`` after returning
                await asyncio.gather(placing, return_exceptions=True)
            pages.abandon()  # a stream cut mid-page leaves no unverified bytes behind
        return pages.count

    # -- sessions ------------------------------------------------------------------------

    def session(self, session_id: str, sync_every: int = 1, sync_ms: float = 50.0, checkpoint: str = "periodic",
                checkpoint_tokens: int = 256) -> SessionLog:
        """The token write-ahead log and KV checkpoint policy of one generation (see
        kvstore.client.session)."""
        return SessionLog(self, session_id, sync_every, sync_ms, checkpoint, checkpoint_tokens)

    async def recover(self, session_id: str) -> Recovery | None:
        """What a crashed generation had returned, how much of its KV is stored, and what
        must be prefilled again; None if the session was never logged (or was ended)."""
        return await recover_session(self, session_id)

    # -- queue hints ---------------------------------------------------------------------

    async def hint(self, tokens: Any, eta_s: float) -> bool:
        """Tells the store a queued request will need ``tokens`` in about ``eta_s`` seconds.
        False means no prefetch space was reserved: recompute rather than wait."""
        return (await self.hint_batch([(tokens, eta_s)]))[0]

    async def hint_batch(self, requests: list[tuple[Any, float]]) -> list[bool]:
        entries = [data_pb2.HintEntry(keys=self.keys(tokens)[: self.max_pages], eta_ms=max(0, int(eta * 1000)))
                   for tokens, eta in requests]
        if not entries:
            return []
        resp = await self._call(self._data.Hint, data_pb2.HintRequest(namespace_id=self.namespace.namespace_id, entries=entries))
        return list(resp.reserved)

    # -- layer-wise ----------------------------------------------------------------------

    def load(self, hit: Hit, into: torch.Tensor | EngineKV, ahead: int = 0, deadline_s: float | None = None) -> LayerLoad:
        """Starts a layer-wise load of ``hit`` into the engine's KV and returns at once.

        ``deadline_s`` bounds every wait (default: the estimated time to recompute the hit,
        at least 50 ms); past it the engine is told to recompute."""
        if hit.namespace_id != self.namespace.namespace_id:
            raise InvalidRequest("the hit belongs to another namespace than this client")
        if deadline_s is None:
            deadline_s = max(0.05, 2 * hit.num_tokens / self.prefill_tokens_per_s)
        load = LayerLoad(self, hit, as_engine_kv(into, self.layout), ahead, deadline_s)
        self._handles.add(load)
        return load

    def save(self, tokens: Any, kv: torch.Tensor | EngineKV, start: int = 0, durable: bool = False) -> LayerSave:
        """Starts a layer-wise save of the full pages of ``tokens`` from token ``start``
        (page-aligned: usually ``hit.num_tokens``) on; see LayerSave."""
        save = LayerSave(self, tokens, as_engine_kv(kv, self.layout), start, durable)
        self._handles.add(save)
        return save

    def suggest_ahead(self, hit_tokens: int, new_tokens: int, compute_s_per_token: float | None = None,
                      bandwidth_bps: float | None = None) -> int:
        """Layers to load before compute starts: S_buf = B·(T_read − T_new) in whole layers,
        with B measured by earlier loads (or given) and T_new from the prefill speed."""
        from kvstore import planner

        bandwidth = bandwidth_bps or self.load_bps or 5e9
        per_token = compute_s_per_token or 1.0 / self.prefill_tokens_per_s
        read_s = hit_tokens * self.layout.bytes_per_token / bandwidth
        return planner.preload_layers(self.layout.num_layers, bandwidth, read_s, new_tokens * per_token)

    def record_load(self, num_bytes: int, seconds: float) -> None:
        if num_bytes and seconds > 0:
            bps = num_bytes / seconds
            self.load_bps = bps if not self.load_bps else 0.7 * self.load_bps + 0.3 * bps

    def _sync(self) -> tuple[Any, Any]:
        if self._sync_channel is None:
            self._sync_channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            self._sync_page_stubs = PageStubs(self._sync_channel)
        return data_pb2_grpc.DataStub(self._sync_channel), directory_pb2_grpc.DirectoryStub(self._sync_channel)

    def _sync_pages(self) -> PageStubs:
        self._sync()
        return self._sync_page_stubs

    def _call_sync(self, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return method(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def acquire_sync(self, keys: list[bytes]) -> Any:
        req = data_pb2.AcquireRequest(namespace_id=self.namespace.namespace_id, keys=keys, ttl_ms=self.lease_ms)
        return self._call_sync(self._sync()[0].Acquire, req)

    def release_sync(self, lease_id: bytes) -> None:
        try:
            self._call_sync(self._sync()[0].Release, data_pb2.ReleaseRequest(lease_id=lease_id))
        except KVStoreError as exc:
            logger.warning("release of lease %s failed (it will expire): %s", lease_id.hex()[:8], exc)

    def renew_sync(self, lease_id: bytes, timeout_s: float) -> None:
        """Extends a lease by ``lease_ms``; raises LeaseExpired when it is already gone."""
        req = data_pb2.RenewRequest(lease_id=lease_id, ttl_ms=self.lease_ms)
        self._call_sync(self._sync()[0].Renew, req, timeout_s)

    def allocate_sync(self, keys: list[bytes]) -> Any:
        req = data_pb2.AllocateRequest(namespace_id=self.namespace.namespace_id, layout=self._layout_msg, keys=keys)
        return self._call_sync(self._sync()[0].Allocate, req)

    def commit_sync(self, allocation_id: bytes, keys: list[bytes], checksums: list[int], durable: bool) -> int:
        """Returns num_published: the leading pages of the allocation stored (durable: on ssd)."""
        req = data_pb2.CommitRequest(allocation_id=allocation_id, keys=keys, checksums=checksums, durable=durable)
        return int(self._call_sync(self._sync()[0].Commit, req).num_published)

    def abort_sync(self, allocation_id: bytes) -> None:
        try:
            self._call_sync(self._sync()[0].Abort, data_pb2.AbortRequest(allocation_id=allocation_id))
        except KVStoreError:
            pass

    def read_pages_sync(self, keys: list[bytes], timeout_s: float | None = None) -> list[torch.Tensor]:
        """Pages over the socket, each verified; stops at the first missing or bad one (or
        when ``timeout_s`` ends the stream). Raises when the stream failed before any page."""
        req = data_pb2.ReadPagesRequest(namespace_id=self.namespace.namespace_id, keys=keys, ttl_ms=self.lease_ms)
        assembler = PageAssembler(keys, self.layout.page_bytes, reuse=False)
        pages: list[torch.Tensor] = []
        try:
            for raw in self._sync_pages().read_pages(req, timeout=timeout_s or self.timeout_s):
                if assembler.feed(decode_chunk(raw)):
                    pages.append(assembler.page)
        except (PageCorrupt, grpc.RpcError) as exc:
            if not pages and isinstance(exc, grpc.RpcError):
                raise self._error(exc) from None
            logger.warning("page stream ended after %d of %d pages: %s", len(pages), len(keys), exc)
        return pages

    def write_pages_sync(self, keys: list[bytes], pages: list[torch.Tensor], checksums: list[int], durable: bool) -> int:
        chunks = (chunk for key, page, csum in zip(keys, pages, checksums)
                  for chunk in self._encode_page(key, page.view(torch.uint8).reshape(-1), csum, durable))
        return int(self._call_sync(self._sync_pages().write_pages, chunks).num_published)
