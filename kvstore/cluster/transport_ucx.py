"""Bulk page bytes node to node over UCX (``ucxx``): the receiver posts its destination
buffers (host-arena slots, any writable buffer) and the sender's bytes land in them, with no
copy through a Python object on either side.

More: kvstore/cluster/README.md (### transport_ucx.py); DESIGN §11.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# UCX logs to stdout unless told otherwise, and warns there at start (ucxx sets
# UCX_MEMTYPE_CACHE, which this UCX does not know): the server's stdout carries its ready
# line, read by launchers, so UCX's messages go to stderr (the server's log) instead.
# Read when UCX loads, i.e. on ``import ucxx``.
os.environ.setdefault("UCX_LOG_FILE", "stderr")
import ucxx

from kvstore.cluster.cluster_errors import DestinationsInUse, TransportError
from kvstore.cluster.page_fetch import (  # noqa: F401  # re-exported
    FetchResult,
    FetchStatus,
    PageSource,
    SourcePage,
    answer_for,
    fetch_flags,
    open_pending,
    start_fetch,
)
from kvstore.cluster.ucx_sends import PageReads, wait_over_cancel
from kvstore.errors import ConfigError, InvalidRequest
from kvstore.logs import Throttled
from kvstore.page import LayoutDesc, checksum
from kvstore.page_wire.fetch_frames import (
    DESCRIBE,
    HELLO_BYTES,
    MAX_FRAME_BYTES,
    NO_ALLOCATION,
    PENDING,
    VERIFY,
    FetchAnswer,
    FetchRequest,
    PageStatus,
    check_keys,
    decode_hello,
    encode_hello,
)
from kvstore.pagecopy import checksum_released

logger = logging.getLogger(__name__)
_refusals = Throttled(logger)  # a scanner at the data port must not flood the log

_ABORT_WAIT_S = 2.0  # how long the receives (sends) cut by an abort get to report their end
HELLO_TIMEOUT_S = 5.0  # a connection that presents no grant within it is dropped
MAX_ADMITTING = 64  # connections still presenting their grant at once; a newer one supersedes the oldest
# An abort drops the bytes UCX has not delivered yet: before it drops a connection at a damaged
# page, the server gives the pages sent before it this long to arrive (without it, on loopback
# under load, 2 test runs in 12 lost the page before it). Late, they are only FAILED (fetched again).
DRAIN_S = 0.2
DAMAGED = "its bytes in the arena do not match its checksum (checked before sending over UCX)"


@dataclass(frozen=True)
class UcxConfig:
    tls: str | None = None            # UCX_TLS, e.g. "tcp" or "sm,self,tcp"; None: UCX chooses
    progress_mode: str = "blocking"   # "blocking" (event loop wakes on UCX events), "polling", "thread"
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.progress_mode not in ("blocking", "polling", "thread", "thread-polling"):
            raise ConfigError(f"--ucx-progress must be blocking, polling or thread, got {self.progress_mode!r}")
        if self.connect_timeout_s <= 0:
            raise ConfigError("--ucx-connect-timeout must be > 0")


_initialized: UcxConfig | None = None


def init_ucx(config: UcxConfig) -> None:
    """Starts UCX in this process with ``config`` (once; a different second config is an error)."""
    global _initialized
    if _initialized is not None:
        if _initialized != config:
            raise ConfigError(f"UCX already runs here with {_initialized}, cannot switch to {config}")
        return
    options = {"TLS": config.tls} if config.tls else {}
    if config.tls and "sm" in config.tls.split(","):
        options["MM_ERROR_HANDLING"] = "y"  # sm through a listener needs it (peer failure detection on sm)
    # In the thread modes a request is awaited through a Python future that ucxx's notifier
    # thread completes; without it (ucxx's default) the loop spins on sleep(0) for as long as
    # any receive is posted, e.g. a page server waiting for a connection's next request.
    threaded = config.progress_mode.startswith("thread")
    ucxx.init(options=options, progress_mode=config.progress_mode, connect_timeout=config.connect_timeout_s,
              enable_python_future=threaded)
    _initialized = config


async def _send_frame(ep: Any, body: bytes) -> None:
    await ep.send(np.array([len(body)], dtype=np.uint64))
    await ep.send(np.frombuffer(body, dtype=np.uint8))


async def _recv_frame(ep: Any, max_bytes: int = MAX_FRAME_BYTES) -> bytearray:
    size = np.empty(1, dtype=np.uint64)
    await ep.recv(size)
    if not 0 < int(size[0]) <= max_bytes:
        raise InvalidRequest(f"frame of {int(size[0])} bytes is out of bounds")
    body = bytearray(int(size[0]))
    await ep.recv(body)
    return body


class UcxPageServer:
    """Serves pages from a ``PageSource`` to any number of fetchers (one task per connection).
    With ``authorize`` (grant -> the node it was issued to, None if not live: grants.py) a
    connection is served only after its first frame presents a live grant; a refusal is
    logged and the connection dropped."""

    def __init__(self, source: PageSource, config: UcxConfig, port: int = 0, send_timeout_s: float = 30.0,
                 authorize: Callable[[bytes], str | None] | None = None) -> None:
        self._source = source
        self._authorize = authorize
        self._config = config
        self._send_timeout_s = send_timeout_s  # a fetcher that stops reading must not pin pages forever
        self._port = port
        self._listener: Any = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._presenting: dict[asyncio.Task[None], None] = {}  # handlers in _admit now, oldest first (one event loop: no lock)

    @property
    def port(self) -> int:
        return int(self._listener.port)

    async def start(self) -> int:
        init_ucx(self._config)
        self._listener = ucxx.create_listener(self._on_connect, port=self._port)
        return self.port

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _on_connect(self, ep: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            if self._authorize is not None:
                if len(self._presenting) >= MAX_ADMITTING:  # peers that present no grant cannot pile up, nor lock nodes out
                    oldest = next(iter(self._presenting))
                    del self._presenting[oldest]
                    oldest.cancel()  # its endpoint is aborted as it unwinds
                    _refusals.warning("busy", "UCX connections to the data port: %d were still presenting their grant; "
                                      "closed the oldest", MAX_ADMITTING)
                self._presenting[task] = None
                try:
                    admitted = await self._admit(ep)
                finally:
                    self._presenting.pop(task, None)
                if not admitted:
                    return
            while True:
                request = FetchRequest.decode(await _recv_frame(ep))
                if not await self._serve(ep, request):
                    return
        except asyncio.CancelledError:
            raise
        except (ucxx.exceptions.UCXError, TimeoutError) as exc:
            logger.debug("page fetcher went away: %r", exc)
        except InvalidRequest as exc:
            logger.warning("dropping a page fetch connection that sent a bad frame: %s", exc)
        except Exception:
            logger.exception("page server connection failed")
        finally:
            self._handlers.discard(task)
            ep.abort()

    async def _admit(self, ep: Any) -> bool:
        """Whether the connection's hello presents a live grant (bounded in size and time: an
        unauthenticated peer gets neither a large buffer nor a handler that waits forever)."""
        assert self._authorize is not None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                grant = decode_hello(await _recv_frame(ep, HELLO_BYTES))
        except InvalidRequest as exc:
            kind, reason = "no-grant", f"no grant ({exc})"
        except TimeoutError:
            kind, reason = "silent", f"no grant within {HELLO_TIMEOUT_S:.0f} s"
        else:
            node = self._authorize(grant)
            if node is not None:
                logger.debug("UCX connection of node %s admitted", node)
                return True
            kind, reason = "bad-grant", "its grant is unknown, used or expired"
        _refusals.warning(kind, "refused a UCX connection to the data port: %s", reason)
        return False

    async def _serve(self, ep: Any, request: FetchRequest) -> bool:
        """Answers one request; False when the connection must be dropped: asked to VERIFY, a
        page failed its check before it was sent (the answer already promised it, so the fetcher
        must see the connection break there, not wait for it; the pages before it go out whole
        first). Unasked, pages go out as they are: the receiver checks each."""
        if request.flags & PENDING:
            pages = await asyncio.to_thread(open_pending, self._source, request)
        else:
            pages = await self._source.open_pages(request.namespace_id, request.keys, request.generation)
        reads = PageReads()  # a cancel of this handler ends its waits, never a send or check reading a page
        try:
            answer = answer_for(request, pages)
            try:
                async with asyncio.timeout(self._send_timeout_s):
                    await _send_frame(ep, answer.encode())
                    if request.flags & DESCRIBE:
                        return True
                    loop = asyncio.get_running_loop()
                    verify = bool(request.flags & VERIFY)  # else the receiver's check is the page's one (fetch_frames.py)
                    for key, page, entry in zip(request.keys, pages, answer.entries):
                        if page is None or entry.status is not PageStatus.FOUND:
                            continue
                        if verify:  # hashed on a worker, GIL released, while the sends posted before it progress
                            check = reads.post(page, loop.run_in_executor(None, checksum_released, page.data))
                            if await asyncio.shield(check) != page.checksum:
                                logger.warning("page %s not sent to a peer: %s", key.hex(), DAMAGED)
                                # reported now, on a worker (the core's lock), while pinned: a cut of the waits below
                                # must not skip it (DESIGN §12.3)
                                reads.post(page, loop.run_in_executor(None, page.damaged, DAMAGED))
                                await reads.ended()
                                await asyncio.sleep(DRAIN_S)  # a send is done once UCX holds its bytes, not the peer
                                return False
                        ranged = request.offset or request.sent_bytes != request.page_bytes
                        data = memoryview(page.data).cast("B")[request.offset : request.offset + request.sent_bytes] if ranged \
                            else page.data
                        reads.post(page, asyncio.ensure_future(ep.send(data)))
                    await reads.ended()
                    return True
            except BaseException:
                ep.abort()  # ends the sends; ucxx may report that late (DESIGN §12.3)
                await reads.after_abort(_ABORT_WAIT_S)
                raise
        finally:
            reads.release(pages)  # each page once no send or check reads it any more


class UcxPageFetcher:
    """The receiving side of one connection to one node's page server. ``grant``: asks the
    server's node for a grant (over its authenticated control plane) before each connect."""

    def __init__(self, host: str, port: int, config: UcxConfig, grant: Callable[[], Awaitable[bytes]] | None = None) -> None:
        self._host, self._port, self._config = host, port, config
        self._grant = grant
        self._ep: Any = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)

    async def close(self) -> None:
        async with self._lock:
            self._drop()

    async def _connect(self) -> None:
        """Connects (and presents a fresh grant) unless the connection is up."""
        if self._ep is not None and not self._ep.alive:
            self._drop()  # the server closed it (restart, idle): connect afresh
        if self._ep is not None:
            return
        init_ucx(self._config)
        grant = await self._grant() if self._grant is not None else None
        ep = await ucxx.create_endpoint(self._host, self._port)
        try:
            if grant is not None:
                await _send_frame(ep, encode_hello(grant))
        except BaseException:
            ep.abort()
            raise
        self._ep = ep

    def _drop(self) -> None:
        if self._ep is not None:
            self._ep.abort()
            self._ep = None

    async def _turn(self, timeout_s: float) -> bool:
        """Takes the connection (one request at a time on it); False when the requests ahead
        held it past ``timeout_s``: a queued call keeps its own deadline, whatever else the peer serves."""
        try:
            async with asyncio.timeout(max(0.001, timeout_s)):
                await self._lock.acquire()
        except TimeoutError:
            return False
        return True

    async def fetch(self, namespace_id: bytes, keys: Sequence[bytes], dests: Sequence[Any], timeout_s: float,
                    generation: int = 0, verify: bool = False, hashed: bool = True, offset: int = 0, page_bytes: int = 0,
                    allocation: bytes = NO_ALLOCATION) -> FetchResult:
        """Fetches ``keys`` of the namespace's ``generation`` into ``dests`` (one writable buffer of the page size per key).
        ``verify``: the sender hashes each page before it sends it (fetch_frames.VERIFY). ``hashed=False``:
        the pages land unhashed, OK with the sender's stored checksum (the consumer's copy checks them:
        ``page_fetch.FetchStatus``). Peer failures are values (FAILED statuses and ``error``), never a
        hang; bad arguments raise InvalidRequest. ``offset``, ``page_bytes``: a range of each page from that
        byte on, as long as ``dests`` (unhashed only: the checksum covers the whole page); ``allocation``: of
        the sender's pages not committed yet (fetch_frames.PENDING; checksums 0)."""
        flags = fetch_flags(verify, hashed, offset, page_bytes, allocation)
        request, views, result = start_fetch(next(self._ids), namespace_id, keys, dests, generation, flags, offset, page_bytes,
                                             allocation)
        receives: list[tuple[int, asyncio.Future[Any]]] = []
        deadline = time.monotonic() + timeout_s
        if not await self._turn(timeout_s):
            result.error = f"TimeoutError: no connection free within {timeout_s:.3g} s"
            logger.warning("fetch of %d pages from %s:%d failed: %s", len(keys), self._host, self._port, result.error)
            return result
        try:
            try:
                async with asyncio.timeout(max(0.001, deadline - time.monotonic())):
                    await self._connect()
                    await _send_frame(self._ep, request.encode())
                    answer = FetchAnswer.decode(await _recv_frame(self._ep), request)
                    for i, entry in enumerate(answer.entries):
                        if entry.status is PageStatus.FOUND:
                            receives.append((i, asyncio.ensure_future(self._ep.recv(views[i]))))
                        else:
                            result.statuses[i] = FetchStatus.MISSING
                    for i, task in receives:  # shielded: a cancel ends this wait, not the receive (_abandon waits for its end)
                        await asyncio.shield(task)
                        result.checksums[i] = answer.entries[i].checksum
                        ok = not hashed or checksum(views[i]) == answer.entries[i].checksum
                        result.statuses[i] = FetchStatus.OK if ok else FetchStatus.CORRUPT
            except (TimeoutError, ucxx.exceptions.UCXError, InvalidRequest, TransportError) as exc:
                result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                logger.warning("fetch of %d pages from %s:%d failed after %d: %s", len(keys), self._host, self._port,
                               result.prefix, result.error)
                await self._abandon([t for _, t in receives])
            except BaseException:
                await self._abandon([t for _, t in receives])
                raise
        finally:
            self._lock.release()
        return result

    async def describe(self, namespace_id: bytes, key: bytes, page_bytes: int, timeout_s: float,
                       generation: int = 0) -> LayoutDesc | None:
        """The layout the sender stored ``key`` with (None: it does not hold it at
        ``page_bytes``, or did not answer in time): what a receiver needs to allocate for it."""
        check_keys(namespace_id, [key])
        request = FetchRequest(next(self._ids), namespace_id, page_bytes, (key,), DESCRIBE, generation)
        deadline = time.monotonic() + timeout_s
        if not await self._turn(timeout_s):
            logger.warning("describe of a page at %s:%d failed: no connection free within %.3g s", self._host, self._port,
                           timeout_s)
            return None
        try:
            async with asyncio.timeout(max(0.001, deadline - time.monotonic())):
                await self._connect()
                await _send_frame(self._ep, request.encode())
                answer = FetchAnswer.decode(await _recv_frame(self._ep), request)
        except (TimeoutError, ucxx.exceptions.UCXError, InvalidRequest, TransportError) as exc:
            logger.warning("describe of a page at %s:%d failed: %r", self._host, self._port, exc)
            self._drop()
            return None
        finally:
            self._lock.release()
        return answer.layout if answer.entries[0].status is PageStatus.FOUND else None

    async def _abandon(self, receives: list[asyncio.Future[Any]]) -> None:
        """Drops the connection and waits until every posted receive has finished, so none can write
        into a destination after ``fetch`` returns (else DestinationsInUse); a cancel meanwhile (its
        caller cutting the fetch) is raised only once the wait is over, as transport_tcp's ``_stop``."""
        self._drop()
        still, cancelled = await wait_over_cancel(receives, _ABORT_WAIT_S)
        if still:  # not seen in tests; if UCX ever does this, the buffers must not be reused
            logger.error("%d receives did not finish after the abort; their buffers may still be written", len(still))
            raise DestinationsInUse("receives still posted after abort; do not reuse the destinations")
        for t in receives:
            if t.done() and not t.cancelled() and (exc := t.exception()) is not None:
                # reported through the statuses; the traceback's frames would keep the caller's
                # buffers exported (an arena slot that cannot be unmapped) until a gc pass
                exc.__traceback__ = None
        if cancelled:
            raise asyncio.CancelledError
