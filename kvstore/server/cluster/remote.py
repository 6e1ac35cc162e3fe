"""The remote tier: pages other nodes hold, read into this node's landing tier.

A page is fetched from its holder (UCX, plain TCP or gRPC ``ReadPages``) into a landing slot allocated
as a writer's would be, then committed, which publishes the new local copy; replicas are made by readers
fetching (DESIGN §12). A fill or handoff lands unhashed (its consumer checks it, DESIGN §4), a replica's
or migration's copy verified. A fetch returns by its deadline; no byte failing a check is committed or served.

More: kvstore/server/cluster/README.md (### remote.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvstore import validate
from kvstore._proto import data_pb2
from kvstore.cluster.cluster_errors import DestinationsInUse
from kvstore.cluster.page_fetch import FetchStatus
from kvstore.errors import KVStoreError, PageCorrupt, StaleGeneration
from kvstore.page import LayoutDesc
from kvstore.page_wire.grpc_chunks import BufferSink, ChunkedPage, decode_chunk
from kvstore.server.cluster.landing import Landing, NodeLanding, NotedLanding
from kvstore.server.cluster.lookup import ShardedLookup, compress
from kvstore.server.cluster.peers import PeerNode, Peers, current_cancelled
from kvstore.server.cluster.source_checks import SourceChecks
from kvstore.server.placement import Placement
from kvstore.types import LocationRun

logger = logging.getLogger(__name__)

FETCH_PAGES = 1024  # pages per fetch request (fetch_frames allows 8192); fetch_from commits one while the next arrives


def _log_failed_commit(commit: asyncio.Future[Any]) -> None:
    if not commit.cancelled() and commit.exception() is not None:
        logger.warning("a fetched batch's commit failed after its copy was cut: %r", commit.exception())


async def _to_the_end(job: asyncio.Future[Any]) -> None:
    """Waits until ``job`` (a worker thread's allocation or commit) has ended, however often the
    fetch is cancelled meanwhile. Why: a cut fetch ends only after it, so that its caller answers,
    and settles the namespace's binding, on what was stored (cluster/loop_calls.py)."""
    while not job.done():
        try:
            await asyncio.wait([job])
        except asyncio.CancelledError:
            continue


def destinations_in_use(exc: BaseException) -> bool:
    """A transfer cut while the transport may still write into its buffers (UCX's receives posted after
    the abort), raised as such or as the cause of a cut call's TimeoutError (loop_calls.run_on)."""
    return isinstance(exc, DestinationsInUse) or isinstance(exc.__cause__, DestinationsInUse)


def _pieces(run: LocationRun, size: int) -> list[LocationRun]:
    return [LocationRun(run.node, run.tier, min(size, run.num_pages - i), run.size_bytes) for i in range(0, run.num_pages, size)]


class RemoteTier:
    name = "remote"

    def __init__(self, core: Placement, peers: Peers, lookup: ShardedLookup, data_plane: str,
                 tenant_of: Callable[[bytes], str | None] = lambda ns: None) -> None:
        self.core = core
        self.node = core.node
        self._peers = peers
        self._lookup = lookup
        self._data_plane = data_plane
        self._node_landing = NodeLanding(core)
        self.num_fetched = 0
        self.source_checks = SourceChecks(core, peers, tenant_of)  # a page landed here that a reader failed: its holder checks its own

    async def close(self) -> None:
        """Cancels the source checks in flight (before the fetchers they use are closed)."""
        await self.source_checks.close()

    def local_prefix(self, namespace_id: bytes, keys: list[bytes]) -> int:
        """How many leading keys this node holds a copy of; a commit's pages are seen all or none (a
        handoff push that named part of a commit would end the decode node's landing of the rest's layers)."""
        return self.core.directory.prefix_length(namespace_id, keys, self.node)

    async def read_into_landing(self, namespace_id: bytes, keys: list[bytes], timeout_s: float, tenant: str = "",
                                landing: Landing | None = None) -> int:
        """Fetches the pages of ``keys`` held only on other nodes into the landing tier, up
        to the first that cannot be had, for ``tenant`` (named to owners and holders; its quota
        is ``landing``'s); returns how many leading keys are now held here."""
        landing = landing or self._node_landing
        deadline = time.monotonic() + timeout_s
        start = self.local_prefix(namespace_id, keys)
        if start == len(keys):
            return start
        runs = compress(await self._lookup.records(namespace_id, keys[start:], timeout_s, tenant))
        pos, noted = start, NotedLanding(landing)
        for again in (False, True):
            got, short = await self._fetch_runs(namespace_id, keys, pos, runs, deadline, tenant, noted)
            pos += got
            if not short or noted.short or again or time.monotonic() >= deadline:
                break
            # a holder had fewer than its record (a cached answer, maybe) said: forgotten, the owners asked again
            self._lookup.cache.forget(keys[pos:], tenant)
            runs = await self._lookup.lookup(namespace_id, keys[pos:], deadline - time.monotonic(), tenant)
        return pos

    async def _fetch_runs(self, namespace_id: bytes, keys: list[bytes], start: int, runs: list[LocationRun], deadline: float,
                          tenant: str, landing: Landing) -> tuple[int, bool]:
        """Fetches ``runs`` (of ``keys[start:]``) in turn until one comes back short: (pages held
        here now past ``start``, whether another node reached held fewer than its run)."""
        pos = start
        for run in (piece for whole in runs for piece in _pieces(whole, FETCH_PAGES)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            want = keys[pos : pos + run.num_pages]
            peer = self._peers.get(run.node)
            if run.node == self.node:
                got = self.local_prefix(namespace_id, want)
            elif peer is None:
                got = 0
            elif peer.fetcher is not None:  # the UCX or TCP plane
                got = await self._fetch_posted(peer, namespace_id, want, run.size_bytes, remaining, landing)
            else:
                got = await self._fetch_grpc(peer, namespace_id, want, remaining, tenant, landing, hashed=False)
            pos += got
            if got < len(want):
                return pos - start, run.node != self.node and peer is not None
        return pos - start, False

    def _layout(self, namespace_id: bytes) -> LayoutDesc | None:
        return self.core.reads.layout_of(namespace_id)

    async def _allocate(self, landing: Landing, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes],
                        generation: int) -> tuple[bytes, list[tuple[bytes, int | None]]] | None:
        """Landing slots for fetched pages, in the generation the fetch asks for (an invalidation
        since: StaleGeneration, nothing allocated); its commit is refused if one comes later. A
        fetch cancelled meanwhile (cut at its caller's deadline) gives back what the thread allocates, then ends."""
        job = asyncio.ensure_future(asyncio.to_thread(landing.allocate, namespace_id, layout, keys, generation))
        try:
            return await asyncio.shield(job)
        except KVStoreError as exc:  # full of leased pages, the quota, another layout or generation: the prefix ends here
            logger.info("no landing room for %d remote pages: %s", len(keys), exc)
            return None
        except asyncio.CancelledError:
            landing.cut()
            await _to_the_end(job)
            self._abort_unused(job)
            raise

    def _abort_unused(self, job: asyncio.Future[tuple[bytes, list[tuple[bytes, int | None]]]]) -> None:
        if not job.cancelled() and job.exception() is None:
            self.core.abort(job.result()[0])  # holds no pin or slot past the fetch's end

    async def _commit(self, landing: Landing, allocation_id: bytes, keys: list[bytes], checksums: list[int],
                      unhashed_from: tuple[bytes, str] | None = None) -> int:
        """Commits what arrived; nothing when the namespace entered another generation meanwhile (the
        fetched bytes are the old one's: never stored, never published). ``unhashed_from`` (namespace,
        node): once committed, the copies are noted as landed from that node unchecked (a commit
        forgets any older note of ``keys``: only the pages that landed are passed). A fetch cut
        meanwhile ends once the commit has (its pages stored or not when its caller answers)."""
        job = asyncio.ensure_future(asyncio.to_thread(self.commit_landed, landing, allocation_id, keys, checksums,
                                                      unhashed_from))
        try:
            n = await asyncio.shield(job)
        except StaleGeneration as exc:
            logger.info("%d fetched pages dropped: %s", len(keys), exc)
            return 0
        except asyncio.CancelledError:
            await _to_the_end(job)
            _log_failed_commit(job)
            self.num_fetched += len(keys) if not job.cancelled() and job.exception() is None else 0
            raise
        self.num_fetched += len(keys)
        return n

    def commit_landed(self, landing: Landing, allocation_id: bytes, keys: list[bytes], checksums: list[int],
                      unhashed_from: tuple[bytes, str] | None) -> int:
        """``landing.commit`` of what arrived, on the calling thread; ``unhashed_from``: as ``_commit``'s."""
        n = landing.commit(allocation_id, keys, checksums)
        if unhashed_from is not None:
            self.core.reads.unchecked.landed(unhashed_from[0], keys, unhashed_from[1])
        return n

    async def _fetch_posted(self, peer: PeerNode, namespace_id: bytes, keys: list[bytes], page_bytes: int, timeout_s: float,
                            landing: Landing | None = None) -> int:
        landing = landing or self._node_landing
        landed = await self._land_posted(peer, namespace_id, keys, page_bytes, timeout_s, landing, hashed=False)
        return 0 if landed is None else await self._commit(landing, *landed[:3], (namespace_id, peer.member.node_id))

    async def _land_posted(self, peer: PeerNode, namespace_id: bytes, keys: list[bytes], page_bytes: int, timeout_s: float,
                           landing: Landing, hashed: bool) -> tuple[bytes, list[bytes], list[int], bool] | None:
        """Allocates landing slots for ``keys`` and fetches their bytes into them, uncommitted: (the
        allocation, the keys that arrived, their checksums, whether every key is held or arrived), or
        None when nothing was allocated. The caller commits or aborts the allocation. Unless ``hashed``
        the bytes land unchecked: the copy that consumes a page checks it (DESIGN §4; the caller's
        ``_commit`` notes ``unhashed_from``, so that a reader that finds one damaged has the holder
        check its own, ``source_checks``)."""
        deadline = time.monotonic() + timeout_s
        generation = self.core.directory.generation(namespace_id)
        layout = self._layout(namespace_id) or await peer.fetcher.describe(namespace_id, keys[0], page_bytes, timeout_s,
                                                                           generation)
        if layout is None or layout.page_bytes != page_bytes:
            return None
        allocated = await self._allocate(landing, namespace_id, layout, keys, generation)
        if allocated is None:
            return None
        allocation_id, slots = allocated
        to_fetch = [k for k, slot in slots if slot is not None]
        ok_sums: list[int] = []
        try:
            if to_fetch:
                views = [self.core.slot_view(allocation_id, k) for k in to_fetch]
                try:
                    ok_sums = await self.fetch_checked(peer, namespace_id, to_fetch, views, deadline, generation, hashed)
                finally:
                    for view in views:
                        view.release()
        except BaseException as exc:
            if not destinations_in_use(exc):
                await asyncio.to_thread(self.core.abort, allocation_id)
            else:  # UCX receives still posted: the slots stay the allocation's until its ttl (bytes may still land there)
                logger.warning("a cut fetch's slots are kept back until their allocation expires: %s", exc)
            raise
        return allocation_id, to_fetch[: len(ok_sums)], ok_sums, len(slots) == len(keys) and len(ok_sums) == len(to_fetch)

    @staticmethod
    async def fetch_checked(peer: PeerNode, namespace_id: bytes, keys: list[bytes], views: list[memoryview], deadline: float,
                             generation: int, hashed: bool) -> list[int]:
        """The checksums of the leading pages that arrived (``hashed``: verified). A holder sends its
        pages unhashed; hashed, from a page that arrived CORRUPT on they are asked for again with the
        holder verifying: a page its own bytes fail is quarantined there and never sent, one damaged on
        the way arrives again."""
        result = await peer.fetcher.fetch(namespace_id, keys, views, max(0.001, deadline - time.monotonic()), generation,
                                          hashed=hashed)
        n = result.prefix
        sums = result.checksums[:n]
        if n < len(keys) and result.statuses[n] is FetchStatus.CORRUPT:
            logger.warning("page %s from %s failed its checksum on arrival; asked again, checked by its holder",
                           keys[n].hex(), peer.member.node_id)
            again = await peer.fetcher.fetch(namespace_id, keys[n:], views[n:], max(0.001, deadline - time.monotonic()),
                                             generation, verify=True)
            sums += again.checksums[: again.prefix]
        return sums

    async def fetch_from(self, node: str, namespace_id: bytes, keys: list[bytes], page_bytes: int, timeout_s: float,
                         tenant: str, landing: Landing | None = None, hashed: bool = True) -> int:
        """Fetches the pages of ``keys`` not held here from ``node`` (a replica the holder asked
        for: no lookup); returns how many leading keys are now held here. ``hashed``: each page
        checked as it lands, for a copy that may become the only one (a replica, a migration), and
        a page held here counted only once checked in place (``checked_prefix``; a fill's unhashed
        landing that won a key's commit meanwhile, after the fetch); a handoff's lands unchecked
        (the holder keeps its copy; the decode side's copy checks it)."""
        landing = landing or self._node_landing
        deadline = time.monotonic() + timeout_s
        pos = self.local_prefix(namespace_id, keys)  # the directory's lock only: a new replica holds none, and takes no thread hop
        if hashed and pos:
            pos = await asyncio.to_thread(self.checked_prefix, namespace_id, keys[:pos])
        peer = self._peers.get(node)
        if peer is not None and peer.fetcher is not None:  # the UCX or TCP plane
            pos = await self._fetch_overlapped(peer, namespace_id, keys, pos, page_bytes, deadline, landing, hashed)
        elif peer is not None:
            while pos < len(keys) and (remaining := deadline - time.monotonic()) > 0:
                want = keys[pos : pos + FETCH_PAGES]
                got = await self._fetch_grpc(peer, namespace_id, want, remaining, tenant, landing, hashed)
                pos += got
                if got < len(want):
                    break
        if hashed and pos:
            await asyncio.to_thread(self.core.reads.check_held, namespace_id, keys[:pos], True)
            pos = self.local_prefix(namespace_id, keys[:pos])
        return pos

    def checked_prefix(self, namespace_id: bytes, keys: list[bytes]) -> int:
        """How many leading keys this node holds a sound copy of, each landing copy checked in place
        first (``Reader.check_held``: a damaged one is dropped). A worker thread's call."""
        held = self.local_prefix(namespace_id, keys)  # the directory's lock only: a new replica holds none, checks none
        if held:
            self.core.reads.check_held(namespace_id, keys[:held])
        return self.local_prefix(namespace_id, keys[:held])

    async def _fetch_overlapped(self, peer: PeerNode, namespace_id: bytes, keys: list[bytes], done: int, page_bytes: int,
                                deadline: float, landing: Landing, hashed: bool) -> int:
        """``fetch_from`` on the UCX or TCP plane, batch by batch, each batch's commit running while
        the next one's bytes arrive. Why: a commit publishes a batch of 1,024 pages in ~20 ms here,
        as long as the batch takes to arrive at 25 GB/s; in series it halved a fast link. ``done``
        leading keys are held here; a batch whose commit falls short, fails or is cut ends the copy
        there, and the one landed behind it is aborted (the result stays the leading pages held here).
        A cut copy ends only once the commit in flight has (see ``_commit``)."""
        committing: tuple[asyncio.Future[int], int] | None = None  # the last batch's commit, how many keys it covers
        more = True
        try:
            while more and (start := done + (committing[1] if committing else 0)) < len(keys) \
                    and (remaining := deadline - time.monotonic()) > 0:
                want = keys[start : start + FETCH_PAGES]
                landed = await self._land_posted(peer, namespace_id, want, page_bytes, remaining, landing, hashed)
                if committing is not None:
                    (commit, size), committing = committing, None
                    try:
                        got = await commit
                    except BaseException:  # it failed, or the copy was cut meanwhile: the batch behind it goes back now
                        if landed is not None:
                            await asyncio.to_thread(self.core.abort, landed[0])
                        raise
                    done += got
                    if got < size:
                        if landed is not None:
                            await asyncio.to_thread(self.core.abort, landed[0])
                        return done
                if landed is None:
                    return done
                allocation_id, ok_keys, ok_sums, more = landed
                source = None if hashed else (namespace_id, peer.member.node_id)
                committing = (asyncio.ensure_future(self._commit(landing, allocation_id, ok_keys, ok_sums, source)), len(want))
            if committing is not None:
                (commit, _), committing = committing, None
                done += await commit
            return done
        finally:
            if committing is not None:  # cut (or failed) while the next batch landed: the copy ends after the commit
                await _to_the_end(committing[0])
                _log_failed_commit(committing[0])

    async def _fetch_grpc(self, peer: PeerNode, namespace_id: bytes, keys: list[bytes], timeout_s: float, tenant: str = "",
                          landing: Landing | None = None, hashed: bool = True) -> int:
        """ReadPages from the holder, each page straight into its landing slot as its
        chunks arrive (allocated once the first chunk names the layout). ``hashed``: checked where
        sent and where landed; else sent and landed unhashed, committed with the holder's checksum
        and noted as from it, as ``_land_posted`` lands them (DESIGN §4)."""
        landing = landing or self._node_landing
        generation = self.core.directory.generation(namespace_id)  # the holder sends only pages of this one
        request = data_pb2.ReadPagesRequest(namespace_id=namespace_id, keys=keys, local_only=True, tenant=tenant,
                                            generation=generation, unchecked=not hashed)
        try:
            call: Any = peer.pages.read_pages(request, timeout=timeout_s)
        except grpc.aio.UsageError:  # its channel closed before the call (it left): as when closed under it, nothing came
            logger.warning("fetch of %d pages from %s over grpc: its channel is closed", len(keys), peer.member.node_id)
            return 0
        allocation_id: bytes | None = None
        page_bytes = 0
        slots: dict[bytes, int | None] = {}
        ok_keys: list[bytes] = []
        ok_sums: list[int] = []
        page: ChunkedPage | None = None
        try:
            async for raw in call:
                chunk = decode_chunk(raw)
                if chunk.error:
                    raise PageCorrupt(f"node {peer.member.node_id} sent {chunk.error}")
                if page is None:
                    if chunk.offset != 0 or len(ok_keys) >= len(keys) or chunk.key != keys[len(ok_keys)]:
                        raise PageCorrupt(f"node {peer.member.node_id} sent a page out of order")
                    if allocation_id is None:
                        layout = validate.layout(chunk.layout)
                        page_bytes = layout.page_bytes
                    if chunk.page_bytes != page_bytes:  # every page: an unhashed one is committed as its chunks say
                        raise PageCorrupt(f"node {peer.member.node_id} sent a page of the wrong size")
                    if allocation_id is None:
                        allocated = await self._allocate(landing, namespace_id, layout, keys, generation)
                        if allocated is None:
                            break
                        allocation_id, answered = allocated
                        slots = dict(answered)
                    if chunk.key not in slots:
                        break  # the allocation's prefix ends before it
                    slot = slots[chunk.key]
                    sink = None if slot is None else BufferSink(self.core.slot_view(allocation_id, chunk.key), clear_on_failure=False)
                    page = ChunkedPage(chunk.key, chunk.page_bytes, chunk.checksum, sink, f"remote page {chunk.key.hex()}",
                                       PageCorrupt, verify=hashed)
                if page.add(chunk):  # whole (hashed: verified; a page stored here already is only checked)
                    ok_keys.append(page.key)
                    ok_sums.append(page.expected)
                    page = None
        except (grpc.aio.AioRpcError, KVStoreError, TimeoutError) as exc:
            logger.warning("fetch of %d pages from %s over grpc ended after %d: %r", len(keys), peer.member.node_id,
                           len(ok_keys), exc)
        except asyncio.CancelledError:
            if current_cancelled():
                if allocation_id is not None:
                    await asyncio.to_thread(self.core.abort, allocation_id)
                raise
            # the peer left and its channel was closed under the stream: what arrived verified stays
            logger.warning("fetch of %d pages from %s over grpc ended with its channel after %d", len(keys),
                           peer.member.node_id, len(ok_keys))
        except BaseException:
            if allocation_id is not None:
                await asyncio.to_thread(self.core.abort, allocation_id)
            raise
        finally:
            call.cancel()
        if allocation_id is None:
            return 0
        source = None if hashed else (namespace_id, peer.member.node_id)
        landed = [i for i, k in enumerate(ok_keys) if slots[k] is not None]  # a page stored here already did not land
        return await self._commit(landing, allocation_id, [ok_keys[i] for i in landed], [ok_sums[i] for i in landed], source)
