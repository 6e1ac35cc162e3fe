"""Bulk page bytes node to node over plain TCP sockets: the same fetch protocol as the UCX
plane (``fetch_frames``: hello with a grant, request, answer, then each found page's bytes in
key order), on blocking sockets driven by threads.

More: kvstore/cluster/README.md (### transport_tcp.py); DESIGN §12.3.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvstore.cluster.cluster_errors import TransportError
from kvstore.cluster.page_fetch import FetchResult, FetchStatus, fetch_flags, start_fetch
from kvstore.cluster.tcp_server import HELLO_TIMEOUT_S, MAX_ADMITTING, TcpPageServer, start_thread  # noqa: F401  # re-exported
from kvstore.cluster.tcp_socket import Deadline, recv_exact, recv_frame, recv_hashed, send_frame, shut, tune
from kvstore.page import LayoutDesc
from kvstore.page_wire.fetch_frames import (
    DESCRIBE,
    MAX_FRAME_BYTES,
    NO_ALLOCATION,
    FetchAnswer,
    FetchRequest,
    PageStatus,
    check_keys,
    encode_hello,
)
from kvstore.pagecopy import running_checksum

logger = logging.getLogger(__name__)

ABORT_WAIT_S = 2.0  # after this long a receiving thread that has not stopped on its shut socket is logged
CONNECTIONS = 1  # per peer node, one fetch on each (tcp_server.MAX_CONNECTIONS_PER_NODE admits 8); see TcpPageFetcher


def _close(sock: socket.socket) -> None:
    shut(sock)
    sock.close()


def _close_made(opening: asyncio.Future[socket.socket]) -> None:
    """Closes the socket a connect nobody waits for any more made (none when it failed)."""
    if not opening.cancelled() and opening.exception() is None:
        _close(opening.result())


class _Receiving:
    """A fetch's receives, run on a thread of their own: not the loop's default executor,
    whose few workers (6 on 2 cores) the cluster loop needs for ``core.acquire`` / allocate /
    commit, a page server's too; fetches holding them all for their deadline would starve
    the senders they wait on. Its failure comes back as a value with no traceback, and it
    drops its hold on the destinations before it reports: a traceback's frames, or a
    reference to them kept a moment after the result is set, would keep the caller's buffers
    exported (an arena that cannot be unmapped) after ``fetch`` returned."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args: tuple[Any, ...] | None = args

    def start(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Exception | None] | None:
        """The future of the receives (None: no thread could be started; nothing was received)."""
        future: asyncio.Future[Exception | None] = loop.create_future()

        def settle(error: Exception | None) -> None:
            if not future.done():
                future.set_result(error)

        def run() -> None:
            error = self.run()
            try:
                loop.call_soon_threadsafe(settle, error)
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                pass

        if not start_thread(run, name="tcp-fetch"):
            self.args = None
            return None
        return future

    def run(self) -> Exception | None:
        args, self.args = self.args, None
        assert args is not None
        error: Exception | None = None
        try:
            TcpPageFetcher.receive(*args)
        except Exception as exc:  # noqa: BLE001 - any failure is the fetch's result, handed to its awaiter
            exc.__traceback__ = exc.__context__ = exc.__cause__ = None
            error = exc
        del args
        return error


class TcpPageFetcher:
    """The receiving side of up to ``CONNECTIONS`` connections to one node's TCP page server
    (one fetch at a time on each; a connection is kept for the next). A get keeps two
    acquires in flight, so two fills may fetch from one node at once; on one connection the
    second waits for the first to end (a stage trace: the wire idle 7-10 ms per fetch while
    the first committed and the sender opened the second's pages). Two connections fill that
    gap where cores are spare, but on the 2-core hosts here they cost 10% more CPU per get
    (143-164 ms against 129-144, interleaved, load 8-11) for no GB/s, so one is the default.
    ``grant``: asks the server's node for a grant over its authenticated control plane
    before each connect."""

    def __init__(self, host: str, port: int, grant: Callable[[], Awaitable[bytes]] | None = None,
                 connect_timeout_s: float = 5.0) -> None:
        self._host, self._port = host, port
        self._grant = grant
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[socket.socket] = []  # connected, no fetch on them
        self._connections = CONNECTIONS
        self._free = asyncio.Semaphore(CONNECTIONS)  # one permit per fetch in flight
        self._ids = itertools.count(1)

    async def close(self) -> None:
        """Closes every connection once the fetches in flight have ended (a later fetch connects again)."""
        for _ in range(self._connections):
            await self._free.acquire()
        try:
            idle, self._idle = self._idle, []
            for sock in idle:
                _close(sock)
        finally:
            for _ in range(self._connections):
                self._free.release()

    async def _connect(self, deadline: Deadline) -> socket.socket:
        """An idle connection, or a new one (with a fresh grant presented). A connect cut off
        (the fetch's deadline, a cancel) closes the socket its thread still makes."""
        if self._idle:
            return self._idle.pop()
        grant = await self._grant() if self._grant is not None else None
        timeout = min(self._connect_timeout_s, max(0.001, deadline.left()))
        opening = asyncio.ensure_future(asyncio.to_thread(self._open, grant, timeout))
        try:
            return await asyncio.shield(opening)
        except BaseException:
            opening.add_done_callback(_close_made)
            raise

    def _open(self, grant: bytes | None, timeout_s: float) -> socket.socket:
        sock = socket.socket(socket.AF_INET6 if ":" in self._host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            tune(sock)  # before connect: the buffers' sizes shape the window the handshake offers
            sock.settimeout(timeout_s)
            sock.connect((self._host, self._port))
            sock.settimeout(None)
            if grant is not None:
                send_frame(sock, encode_hello(grant), Deadline(timeout_s))
        except BaseException:
            sock.close()
            raise
        return sock

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
        await self._exchange(request, views, result, timeout_s, hashed)
        return result

    async def describe(self, namespace_id: bytes, key: bytes, page_bytes: int, timeout_s: float,
                       generation: int = 0) -> LayoutDesc | None:
        """The layout the sender stored ``key`` with (None: it does not hold it at
        ``page_bytes``, or did not answer in time): what a receiver needs to allocate for it."""
        check_keys(namespace_id, [key])
        request = FetchRequest(next(self._ids), namespace_id, page_bytes, (key,), DESCRIBE, generation)
        result = FetchResult([FetchStatus.FAILED])
        answer = await self._exchange(request, [], result, timeout_s)
        return answer.layout if answer is not None and answer.entries[0].status is PageStatus.FOUND else None

    async def _exchange(self, request: FetchRequest, views: list[memoryview], result: FetchResult,
                        timeout_s: float, hashed: bool = True) -> FetchAnswer | None:
        """One request on a connection of its own, its receives on a thread of their own;
        whatever happens, returns only once that thread stopped touching ``views``. The
        connection is kept for the next fetch only when this one ended cleanly."""
        deadline = Deadline(timeout_s)
        try:  # a fetch queued behind another on the connection waits at most its own deadline
            async with asyncio.timeout(max(0.001, deadline.left())):
                await self._free.acquire()
        except TimeoutError:
            self._fail(result, TimeoutError(f"no connection free within {timeout_s:.3g} s"), request)
            return None
        try:
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for returns a connect that ended as it was cancelled,
                # swallowing the cancel (a cancelled source check then waited out its 10 s on a stalled peer)
                async with asyncio.timeout(max(0.001, deadline.left())):
                    sock = await self._connect(deadline)
            except (OSError, TimeoutError, TransportError) as exc:
                self._fail(result, exc, request)
                return None
            try:
                answer = await self._on(sock, request, views, result, deadline, timeout_s, hashed)
            except BaseException:
                _close(sock)
                raise
            if result.error is None:
                self._idle.append(sock)
            else:
                _close(sock)
            return answer
        finally:
            self._free.release()

    async def _on(self, sock: socket.socket, request: FetchRequest, views: list[memoryview], result: FetchResult,
                  deadline: Deadline, timeout_s: float, hashed: bool) -> FetchAnswer | None:
        answer: list[FetchAnswer] = []
        receiving = _Receiving((sock, request, views, result, deadline, answer, hashed)).start(asyncio.get_running_loop())
        if receiving is None:
            self._fail(result, TransportError("cannot start a thread for the fetch"), request)
            return None
        late = False
        try:
            done, _ = await asyncio.wait({receiving}, timeout=max(0.0, deadline.left()) + 0.05)
            if not done:  # the kernel's timeout has not ended the receive yet (a busy host): end it
                late = True
                if await self._stop(receiving, sock):
                    raise asyncio.CancelledError  # cancelled while it stopped: after the thread, as below
        except BaseException:  # cancelled: the thread must stop before the caller gets its buffers back
            await self._stop(receiving, sock)
            raise
        if (exc := receiving.result()) is not None:
            self._fail(result, TimeoutError(f"no answer within {timeout_s:.3g} s") if late else exc, request)
        return answer[0] if answer and result.error is None else None

    @staticmethod
    async def _stop(receiving: asyncio.Future[Exception | None], sock: socket.socket) -> bool:
        """Shuts the socket and waits until the receiving thread stopped; True when the task
        was cancelled meanwhile (the caller raises it once this returns). Not bounded by
        ABORT_WAIT_S (after it, an error is logged each time): once its socket is shut the
        thread only drains what the kernel already holds, whatever the peer does, and
        returning earlier hands back buffers it still writes (the caller frees them: a
        second cancel, or a thread slower than the abort wait, did so)."""
        shut(sock)
        cancelled = False
        t0 = time.monotonic()
        while not receiving.done():
            try:
                await asyncio.wait({receiving}, timeout=max(ABORT_WAIT_S, 0.01))
            except asyncio.CancelledError:
                cancelled = True
            if not receiving.done() and time.monotonic() - t0 >= ABORT_WAIT_S:
                logger.error("a TCP receive has not stopped %.1f s after its socket was shut; the fetch waits for it",
                             time.monotonic() - t0)
        return cancelled

    def _fail(self, result: FetchResult, exc: BaseException, request: FetchRequest) -> None:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        exc.__traceback__ = None  # its frames would keep the caller's buffers exported
        logger.warning("fetch of %d pages from %s:%d failed after %d: %s", len(request.keys), self._host, self._port,
                       result.prefix, result.error)

    @staticmethod
    def receive(sock: socket.socket, request: FetchRequest, views: list[memoryview], result: FetchResult,
                 deadline: Deadline, answer_out: list[FetchAnswer], hashed: bool = True) -> None:
        """The thread: request out, answer in, then every found page into its buffer, each
        chunk hashed as it lands (``hashed``; else OK with the stored checksum, unchecked).
        Raises on any transport or protocol failure."""
        send_frame(sock, request.encode(), deadline)
        answer = FetchAnswer.decode(recv_frame(sock, MAX_FRAME_BYTES, deadline), request)
        answer_out.append(answer)
        for i, entry in enumerate(answer.entries):
            if entry.status is not PageStatus.FOUND:
                result.statuses[i] = FetchStatus.MISSING
        if request.flags & DESCRIBE:
            return
        for i, entry in enumerate(answer.entries):
            if entry.status is not PageStatus.FOUND:
                continue
            result.checksums[i] = entry.checksum
            if not hashed:
                deadline.arm(sock)
                recv_exact(sock, views[i], deadline)
                result.statuses[i] = FetchStatus.OK
                continue
            digest = running_checksum()
            recv_hashed(sock, views[i], digest, deadline)
            result.statuses[i] = FetchStatus.OK if digest.intdigest() == entry.checksum else FetchStatus.CORRUPT
