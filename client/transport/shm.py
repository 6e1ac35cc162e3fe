"""Pages through the server's shared-memory arena (client and server on one host).

Writes: Allocate slots, copy the pages in, Commit (or Abort). Reads: Acquire a lease on
the pages' slots, copy them out verifying each checksum, Release (or Renew, for a long
layer-wise load). The copies run on a small pool of copy threads (numpy releases the GIL);
the pipelines that overlap them with the RPCs are in ``shm_pipeline``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from kvstore._proto import data_pb2
from kvstore.client.arena import ArenaMap
from kvstore.client.device_pool import PoolSource
from kvstore.client.engine_kv import EngineKV
from kvstore.client.pages import KVRows, slot_as_page
from kvstore.client.staging import staging_page
from kvstore.client.transport import shm_pipeline
from kvstore.client.transport.contract import NamespaceServer, page_in, page_out
from kvstore.client.transport.shm_staged import LeasedPages, SlotOutgoing
from kvstore.errors import KVStoreError
from kvstore.pagecopy import copy_checksum, copy_checksum_bytes

logger = logging.getLogger(__name__)

T = TypeVar("T")
PIPELINE_PAGES = 64
RAMP_PAGES = 8  # the first batch of a transfer; each next one doubles up to the full batch
INLINE_COPY_BYTES = 128 << 10  # a batch this small is copied on the runtime loop (a thread hop costs more)


def _on_cuda(kv: torch.Tensor | EngineKV) -> bool:
    layers = getattr(kv, "layers", None)  # a PagedKV's block tensors
    first = kv if isinstance(kv, torch.Tensor) else layers[0] if layers else None
    return isinstance(first, torch.Tensor) and first.device.type == "cuda"


class ShmTransport:
    """The shared-memory path (see kvstore.client.transport.contract.Transport for the contract).

    Owns the client's mapping of the arena and closes it."""

    def __init__(self, peer: NamespaceServer, arena: ArenaMap, copy_threads: int, pool_socket: str = "",
                 bearer: str | None = None) -> None:
        """``pool_socket`` (GetInfo's) and ``bearer``: where this client gets its tenant's hbm pool."""
        self.peer = peer
        self.pools = PoolSource(pool_socket, bearer) if pool_socket else None  # mapped at the first device load
        self.layout = peer.layout
        self.arena = arena
        self.copy_threads = copy_threads
        self._pool = ThreadPoolExecutor(max_workers=copy_threads, thread_name_prefix="kv-copy")
        self._old_arenas: list[ArenaMap] = []  # of servers before a restart, retired: closed with their last user
        self.relearn: Callable[[], Awaitable[object]] | None = None  # maps the restarted server's arena (client/restart.py)
        self._lock = threading.Lock()

    @property
    def arena_bytes(self) -> int:
        """The size of the arena mapped now: a restarted server's may be another (it sizes batches)."""
        return self.arena.size_bytes

    def remap(self, arena: ArenaMap) -> None:
        """Takes the arena of the restarted server (client/restart.py). The old one is retired:
        closed once its last user (a copy, a layer-wise load or save holding it) drops it. It is
        the last holder of the dead server's arena (its file unlinked, or a memfd), whose RAM
        stays taken while it is mapped."""
        with self._lock:
            old, self.arena = self.arena, arena
            self._old_arenas = [a for a in self._old_arenas if not a.closed] + [old]
        old.retire()

    async def mapping(self, answer: Any, give_back: Callable[[], Awaitable[None]]) -> ArenaMap:
        """The mapping of the arena an Allocate or Acquire ``answer`` names its offsets in, held
        for the caller (``drop`` it once its copies are done). After a restart the answer may be
        the new server's before this client mapped its arena, or the old one's after: copying
        through another mapping would read or write the wrong server's bytes (the new arena's
        pages overwritten at the old offsets). An arena not mapped yet is mapped first; one that
        cannot be: ``give_back`` the answer and KVStoreError (retry)."""
        token = bytes(answer.arena_token)
        found = self._mapped(token)
        if found is None and self.relearn is not None:
            await self.relearn()
            found = self._mapped(token)
        if found is None:
            await give_back()
            raise KVStoreError("the server restarted and its new arena is not mapped here yet; try again")
        return found

    def _mapped(self, token: bytes) -> ArenaMap | None:
        """The mapping of ``token``'s arena, held; None when none is mapped (or it closed)."""
        with self._lock:
            if not token or self.arena.token == token:  # an answer without a token: a server before tokens
                found: ArenaMap | None = self.arena
            else:
                found = next((a for a in self._old_arenas if a.token == token), None)
        return found if found is not None and found.hold() else None

    def close(self) -> None:
        """After the client's loads and saves ended (client.close abandons and joins them). An
        arena still held (a handoff's receive holds its lease's until given back) closes with
        its last user."""
        self._pool.shutdown(wait=True)
        for arena in (*self._old_arenas, self.arena):
            arena.retire()
        if self.pools is not None:
            self.pools.close()

    # -- the RPCs of the arena path: one method each ---------------------------------------

    async def allocate(self, keys: list[bytes], parent: bytes = b"", generation: int | None = None,
                       session_id: str = "") -> Any:
        """Slots for ``keys`` (``slot.exists``: the page is stored already, nothing to copy);
        ``parent``: the page before ``keys[0]`` in its prefix (the server evicts tails first);
        ``generation``: the namespace generation the pages were computed in (refused if it is over);
        ``session_id``: the session they are saved for (refused, also at commit, once it is fenced there)."""
        request = data_pb2.AllocateRequest(namespace_id=self.peer.namespace_id, layout=self.peer.layout_msg, keys=keys,
                                           parent=parent, session_id=session_id)
        if generation is not None:
            request.generation = generation
        return await self.peer.calls.unary("Data.Allocate", request)

    async def commit(self, allocation_id: bytes, keys: list[bytes], checksums: list[int], durable: bool,
                     flags: int = 0) -> int:
        """Publishes the copied slots; returns num_published: the leading pages of the
        allocation stored (durable: on ssd)."""
        answer = await self.peer.calls.unary("Data.Commit", data_pb2.CommitRequest(
            allocation_id=allocation_id, keys=keys, checksums=checksums, durable=durable, flags=flags))
        return int(answer.num_published)

    async def abort(self, allocation_id: bytes) -> None:
        """Gives an allocation back (one that failed its commit is gone already: debug)."""
        request = data_pb2.AbortRequest(allocation_id=allocation_id)
        await self._give_back("Data.Abort", request, f"allocation {allocation_id.hex()[:8]}", logging.DEBUG)

    async def acquire(self, keys: list[bytes], device: bool = False) -> Any:
        """A lease on the slots of the longest stored prefix of ``keys`` that fits; ``device``:
        the server also places them in this client's hbm pool (answered as device offsets)."""
        return await self.peer.calls.unary("Data.Acquire", data_pb2.AcquireRequest(
            namespace_id=self.peer.namespace_id, keys=keys, ttl_ms=self.peer.lease_ms, device=device))

    async def release(self, lease_id: bytes, failed: list[bytes] | None = None) -> None:
        """Gives a lease back; ``failed``: its pages whose copy failed the checksum (the server
        checks them and quarantines those that fail: placement/reported.py)."""
        request = data_pb2.ReleaseRequest(lease_id=lease_id, failed=failed or [])
        await self._give_back("Data.Release", request, f"lease {lease_id.hex()[:8]}", logging.WARNING)

    async def _give_back(self, method: str, request: Any, what: str, level: int) -> None:
        """A call that gives something back never raises: a failure is left to its expiry."""
        try:
            await self.peer.calls.unary(method, request)
        except KVStoreError as exc:
            logger.log(level, "giving back %s failed (it will expire): %s", what, exc)

    async def renew(self, lease_id: bytes, timeout_s: float, ttl_ms: int | None = None, layers_written: int = 0) -> None:
        """Extends a lease by ``lease_ms`` (an allocation by ``ttl_ms``, 0: its own term;
        ``layers_written``: its leading layers stored in every slot); raises LeaseExpired when
        it is already gone."""
        ttl = self.peer.lease_ms if ttl_ms is None else ttl_ms
        request = data_pb2.RenewRequest(lease_id=lease_id, ttl_ms=ttl, layers_written=layers_written)
        await self.peer.calls.unary("Data.Renew", request, timeout_s)

    async def granted(self, request: Coroutine[Any, Any, T], give_back: Callable[[T], Awaitable[None]]) -> T:
        """Awaits an RPC that grants something (a lease, an allocation). If the caller is
        cancelled meanwhile, the answer is still awaited and what it granted given back."""
        answer = asyncio.ensure_future(request)
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            try:
                await give_back(await answer)
            except KVStoreError:
                pass  # nothing was granted
            raise

    # -- copies ----------------------------------------------------------------------------

    def batch_pages(self) -> int:
        """Pages per Allocate/Acquire: small enough that copying one batch overlaps the
        server's work on others, and at most a sixth of the arena so that the batches in
        flight (one allocated ahead, two being copied, up to three committing) always fit."""
        arena_pages = self.arena_bytes // max(1, self.layout.page_bytes)
        return max(1, min(self.peer.max_pages, arena_pages // 6, PIPELINE_PAGES))

    def batch_sizes(self) -> Iterator[int]:
        """The batch sizes of one transfer: from RAMP_PAGES, doubling up to ``batch_pages``,
        so that the other side starts working after a short first batch."""
        full = self.batch_pages()
        size = min(full, RAMP_PAGES)
        while True:
            yield size
            size = min(full, size * 2)

    def copy(self, fn: Callable[[Any], T], items: list[Any], cpu_rows: bool) -> asyncio.Future[list[T]]:
        """fn over items on the copy threads, in order; contiguous shares per thread. Not
        awaited here, so that callers can queue the next batch behind this one. A batch of
        at most INLINE_COPY_BYTES between the arena and the rows of a CPU tensor (``cpu_rows``:
        numpy copies, no engine code) is copied here at once: two thread hops cost more."""
        loop = asyncio.get_running_loop()
        if cpu_rows and len(items) * self.layout.page_bytes <= INLINE_COPY_BYTES:
            done: asyncio.Future[list[T]] = loop.create_future()
            try:
                done.set_result([fn(x) for x in items])
            except Exception as exc:  # noqa: BLE001 - delivered to whoever awaits the copy, as from a thread
                done.set_exception(exc)
            return done
        share = max(1, -(-len(items) // self.copy_threads))
        parts = [items[i : i + share] for i in range(0, len(items), share)]
        def share_of(part: list[Any]) -> list[T]:
            return [fn(x) for x in part]

        futures = [loop.run_in_executor(self._pool, share_of, part) for part in parts]

        async def joined() -> list[T]:
            results = await asyncio.gather(*futures, return_exceptions=True)  # all shares end before this does
            for part in results:
                if isinstance(part, BaseException):
                    raise part
            return [r for part in results for r in part]  # type: ignore[union-attr]

        return asyncio.ensure_future(joined())

    def write_slot(self, kv: torch.Tensor | EngineKV, rows: KVRows | None, page: int, offset: int,
                   arena: ArenaMap | None = None) -> int:
        """Copies page ``page`` of the engine's KV into the arena slot at ``offset`` and
        returns its checksum. From a CPU tensor it is one strided numpy copy of the rows.
        ``arena``: the one mapped when the allocation was answered (its offsets are that
        server's; a restart may remap ``self.arena`` before a copy thread runs)."""
        n, arena = self.layout.page_bytes, arena or self.arena
        slot = arena.array[offset : offset + n]
        if rows is not None:
            return copy_checksum(slot.reshape(rows.rows.shape[0], -1), rows.page(page).rows)
        # The slot is shared memory another process may write: the page is gathered into this
        # thread's own buffer and copied into the slot from there, hashing the bytes stored (hashing
        # the slot after writing it would commit another writer's bytes with their own checksum).
        private = staging_page(n, _on_cuda(kv))
        page_in(slot_as_page(private, self.layout), kv, page, self.layout)  # blocking: private holds the page
        return copy_checksum_bytes(slot, private.numpy())

    def read_slot(self, into: torch.Tensor | EngineKV, rows: KVRows | None, page: int, acquired: Any,
                  arena: ArenaMap | None = None) -> bool:
        """Copies the leased slot into page ``page`` of ``into`` and verifies it; False when
        the bytes fail their checksum, and then that page of ``into`` is zeroed: no byte of a
        corrupt page reaches the caller. ``arena``: as for ``write_slot``."""
        n, arena = self.layout.page_bytes, arena or self.arena
        slot = arena.array[acquired.offset : acquired.offset + n]
        if rows is not None:  # verified as it is copied (one pass); a bad page is wiped before anyone sees it
            dst = rows.page(page)
            if copy_checksum(dst.rows, slot.reshape(rows.rows.shape[0], -1)) == acquired.checksum:
                return True
            dst.clear()
            return False
        # The arena is shared memory another process may write: the page is read from it once,
        # into this thread's own buffer, verified there and copied on from there (checksumming
        # the slot and then copying the slot could land bytes that were never verified).
        private = staging_page(n, _on_cuda(into))
        if copy_checksum_bytes(private.numpy(), slot) != acquired.checksum:
            return False
        page_out(into, page, slot_as_page(private, self.layout), self.layout)  # blocking: the buffer is free after it
        return True

    # -- put / get / layer-wise ------------------------------------------------------------

    async def put(self, keys: list[bytes], kv: torch.Tensor | EngineKV, durable: bool, flags: int,
                  generation: int | None = None, session_id: str = "") -> int:
        return await shm_pipeline.put(self, keys, kv, durable, flags, generation, session_id)

    async def get(self, keys: list[bytes], into: torch.Tensor | EngineKV) -> None:
        await shm_pipeline.get(self, keys, into)

    def staged(self, on_device: bool = False) -> LeasedPages:
        """``on_device``: the load copies on a device; its pages are read from this client's
        hbm pool where the server placed them there (shm_staged.py)."""
        return LeasedPages(self, on_device)

    def outgoing(self, session_id: str = "", generation: int | None = None) -> SlotOutgoing:
        return SlotOutgoing(self, session_id, generation)
