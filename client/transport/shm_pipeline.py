"""The arena path's put and get: RPCs overlapped with copies, batch by batch.

Both run on the runtime loop; the copies run on the transport's copy threads. Whatever
ends them (an error, a cancellation, the client closing), they first let the copies
finish and then give back every allocation not committed and every lease taken. So they
await their RPCs and copies shielded, and take one off its queue only once it is
settled: a cancellation never cuts an RPC whose answer (an allocation, a lease) would be
lost, and the cleanup sees everything still in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from kvstore.client.engine_kv import EngineKV
from kvstore.client.hit import missing, partial, published_prefix
from kvstore.client.pages import page_rows
from kvstore.errors import KVStoreError, PageCorrupt, TierFull

if TYPE_CHECKING:
    from kvstore.client.arena import ArenaMap
    from kvstore.client.transport.shm import ShmTransport

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def _all_done(futures: list[asyncio.Future[None]]) -> None:
    """Waits for every future; unlike gather, a cancelled waiter does not cancel them."""
    if futures:
        await asyncio.wait(futures)


async def put(shm: ShmTransport, keys: list[bytes], kv: torch.Tensor | EngineKV, durable: bool, flags: int,
              generation: int | None = None, session_id: str = "") -> int:
    """Allocate, copy, commit batch by batch, overlapped: two batches are queued on the
    copy threads (so they never wait between batches), the next one is being allocated
    and up to two earlier ones commit (and, when durable, are written to ssd).
    Returns pages stored (a prefix)."""
    rows = page_rows(kv, shm.layout)
    stored = cursor = 0
    copying: deque[tuple[Any, list[Any], asyncio.Future[list[Any]]]] = deque()
    commits: deque[tuple[int, asyncio.Future[int]]] = deque()  # (pages asked, num_published)
    short = False  # a commit came back short: the stored prefix ended there
    ahead: asyncio.Future[Any] | None = None
    sizes = shm.batch_sizes()

    def allocate(start: int) -> asyncio.Future[Any]:
        return asyncio.ensure_future(shm.allocate(keys[start : start + next(sizes)], keys[start - 1] if start else b"", generation,
                                                  session_id))

    async def commit_after(before: asyncio.Future[int] | None, alloc: Any, todo: list[Any], sums: list[Any]) -> int:
        # Commits of one put reach the server in order: over the call socket's pool two of
        # them could be served out of order, and a batch committed before the one it extends
        # joins the tier as an orphan (kvstore/server/placement/chains.py) while its predecessor may be evicted.
        if before is not None:
            await asyncio.gather(before, return_exceptions=True)
        return await shm.commit(alloc.allocation_id, [slot.key for _, slot in todo], sums, durable, flags)

    async def commit_oldest() -> None:
        alloc, todo, copied = copying[0]
        sums = await asyncio.shield(copied)
        copying.popleft()
        before = commits[-1][1] if commits else None
        commits.append((len(alloc.slots), asyncio.ensure_future(commit_after(before, alloc, todo, sums))))

    async def settle_oldest() -> None:
        nonlocal stored, short
        asked, answer = commits[0]
        num_published = await asyncio.shield(answer)
        commits.popleft()
        n = published_prefix(asked, num_published, durable, stored, shm.layout.page_tokens)
        if not short:
            stored += n
        short = short or n < asked

    try:
        ahead = allocate(0) if keys else None  # less than a page: nothing to store (the server refuses an empty Allocate)
        while ahead is not None or copying:
            if ahead is None or len(copying) >= 2:
                await commit_oldest()
                if len(commits) > 2:
                    await settle_oldest()
                continue
            try:
                alloc = await asyncio.shield(ahead)
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
            arena = await shm.mapping(alloc, _aborted_below)  # ``ahead`` still holds it: aborted in the finally below
            n = len(alloc.slots)
            todo = [(i, slot) for i, slot in enumerate(alloc.slots) if not slot.exists]
            copying.append((alloc, todo, _holding(arena, shm.copy(
                lambda item, base=cursor, arena=arena: shm.write_slot(kv, rows, base + item[0], item[1].offset, arena),
                todo, rows is not None))))
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
            await shm.abort(alloc.allocation_id)
        if commits:
            await asyncio.gather(*(answer for _, answer in commits), return_exceptions=True)
    return stored


async def get(shm: ShmTransport, keys: list[bytes], into: torch.Tensor | EngineKV) -> None:
    """Two acquires in flight (the server may be reading them from ssd: while it answers
    one it already works on the next) while two batches are queued on the copy threads;
    each lease is released as soon as its copy is done.

    The second acquire asks for the range after the first as if the first came back
    whole; when one comes back short (the host tier could not take more promoted pages)
    the ones issued after it are stale: they are released unused and asked again from
    where the short one ended. When the tier is full while our own leases hold space,
    the request waits for one of them to go and asks again; TierFull reaches the caller
    only when nothing of ours is held."""
    page_tokens = shm.layout.page_tokens
    rows = page_rows(into, shm.layout)
    sizes = shm.batch_sizes()
    issued = 0  # the first page not yet asked for
    generation = 0  # bumped when a short answer makes the acquires in flight stale
    pending: deque[tuple[int, int, asyncio.Future[Any]]] = deque()  # (generation, pages asked, answer)

    def acquire() -> None:
        nonlocal issued
        size = min(next(sizes), len(keys) - issued)
        pending.append((generation, size, asyncio.ensure_future(shm.acquire(keys[issued : issued + size]))))
        issued += size

    releases: list[asyncio.Future[None]] = []

    def release(lease_id: bytes, failed: list[bytes] | None = None) -> None:
        releases.append(asyncio.ensure_future(shm.release(lease_id, failed)))

    done = cursor = 0  # pages verified and in place / pages handed to the copy threads
    copying: deque[tuple[Any, asyncio.Future[list[bool]]]] = deque()
    gone = False  # a page was missing: nothing after it is asked for
    held_back = False  # the host tier was full: ask again once one of our leases is gone
    try:
        while True:
            while not (gone or held_back) and len(pending) < 2 and issued < len(keys):
                acquire()
            if not pending and not copying:
                if held_back and not gone and issued < len(keys):
                    await _all_done(releases)  # all ours are back
                    held_back = False
                    continue  # one more try: a second TierFull with nothing held raises
                break
            if pending and len(copying) < 2:
                gen, asked, answer = pending[0]
                try:
                    acq = await asyncio.shield(answer)
                except TierFull:
                    pending.popleft()
                    if gen != generation or gone:
                        continue
                    if not copying and not pending:
                        raise  # nothing of ours holds the space: the tier is full of other leases
                    generation += 1  # our own leases hold it: retry when one is released
                    issued, held_back = cursor, True
                    continue
                pending.popleft()
                if gen != generation or gone:
                    release(acq.lease_id)  # stale, or past a missing page
                    continue
                if not acq.pages:
                    release(acq.lease_id)
                    gone = True
                    continue  # the batches before it are still checked below
                try:
                    arena = await shm.mapping(acq, _aborted_below)
                except BaseException:  # cancelled too: the lease goes back
                    release(acq.lease_id)
                    raise
                if len(acq.pages) < asked:
                    generation += 1
                    issued = cursor + len(acq.pages)
                copying.append((acq, _holding(arena, shm.copy(
                    lambda item, base=cursor, arena=arena: shm.read_slot(into, rows, base + item[0], item[1], arena),
                    list(enumerate(acq.pages)), rows is not None))))
                cursor += len(acq.pages)
                continue
            if not copying:  # only stale acquires left: let them come back and be released
                continue
            acq, copied = copying[0]
            ok = await asyncio.shield(copied)  # on failure the cleanup waits for it, then releases
            copying.popleft()
            release(acq.lease_id, [page.key for page, good in zip(acq.pages, ok, strict=True) if not good])
            if held_back:
                await _all_done(releases)  # the space is free before we ask again
                held_back = False
            for i, good in enumerate(ok):
                if not good:
                    raise partial(PageCorrupt, f"page {done + i} failed its checksum; "
                                  f"{(done + i) * page_tokens} tokens are valid, recompute the rest", (done + i) * page_tokens)
            done += len(ok)
        if gone or done < len(keys):
            raise missing(len(keys), done, page_tokens)
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


def _holding(arena: ArenaMap, copied: asyncio.Future[list[T]]) -> asyncio.Future[list[T]]:
    """``copied``, with ``arena`` (held by ``mapping``) dropped once the copy ended."""
    copied.add_done_callback(lambda _: arena.drop())
    return copied


async def _aborted_below() -> None:
    """An answer whose arena is not mapped: the caller gives it back (``put``: its cleanup aborts ``ahead``)."""
