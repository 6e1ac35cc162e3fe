"""Unary calls over the call socket from coroutines of one event loop (README.md): the client's
runtime loop, and (``sibling``) a caller's own loop.

Same frames, HELLO and ``call_token`` check as the blocking channel; a small pool of
connections, one call at a time on each. ``NotSent``: the request never reached the server,
the caller may take gRPC. A call past its deadline (or cancelled) shuts the connection's
reading side; an answer that had arrived is given back (Release, Abort) on a task of its own.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from kvstore._proto import data_pb2, directory_pb2
from kvstore.callsocket import frames
from kvstore.callsocket.client_sync import GIVE_BACK_S, RELEARN_S, UNAUTHENTICATED, answer_error, drain_late, take_over
from kvstore.errors import KVStoreError
from kvstore.security.socket_owner import check_served_by_us

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 8  # calls of one client in flight at once on the socket (a put pipeline has ~5)
_RETRY_S = 1.0  # after the socket failed to take a call, gRPC alone this long (no connect per call)
# What asks the server over gRPC for (its call socket, its call token) now; None when that failed or it offers no socket.
AsyncRelearn = Callable[[], Awaitable["tuple[str, bytes] | None"]]
_HELLO_S = 2.0  # the most a HELLO may take (a stalled server or a stranger's socket)


class NotSent(KVStoreError):
    """The call never reached the server: the caller may make it over gRPC."""


class _Gone(Exception):
    """The server closed the connection (or sent what no answer is)."""


class AsyncCallChannel:
    """The call socket for coroutines of one event loop (the client's runtime loop)."""

    def __init__(self, path: str, token: str | None, call_token: bytes, relearn: AsyncRelearn | None = None,
                 max_connections: int = MAX_CONNECTIONS, queue: bool = True) -> None:
        """``queue``: a call that finds all ``max_connections`` busy waits for one (until its
        deadline); without, it is NotSent at once (its caller has another way)."""
        self.path = path
        self._hello = frames.request_frame(frames.HELLO, 0, (token or "").encode())
        self._call_token = call_token
        self._relearn = relearn
        self._learn_after = 0.0  # no new call token is asked for before this (loop time)
        self._idle: list[socket.socket] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._queue = queue
        self._down_until = 0.0
        self._retired = False  # closed: gRPC from here on
        self._give_backs: set[asyncio.Task[None]] = set()
        self.num_late = 0  # answers that came after their deadline and were given back here

    @classmethod
    async def open(cls, path: str, token: str | None, call_token: bytes,
                   relearn: AsyncRelearn | None = None) -> AsyncCallChannel | None:
        """A channel whose first connection said HELLO; None (reason logged) when this host
        cannot use the socket (another uid, not this server's, the token refused).
        ``relearn()`` asks the server over gRPC for its call socket and call token now: after
        a restart the channel takes the new server's socket (see ``_learn``)."""
        if not path or len(call_token) != frames.CALL_TOKEN_BYTES:
            return None
        channel = cls(path, token, call_token, relearn)
        loop = asyncio.get_running_loop()
        try:
            channel._idle.append(await channel._connect(loop.time() + _HELLO_S))
        except KVStoreError as exc:
            logger.info("call socket %s not usable from the async client (%s); unary calls go over gRPC", path, exc)
            return None
        return channel

    def sibling(self, hop: Callable[[Awaitable[Any]], Awaitable[Any]], max_connections: int) -> AsyncCallChannel:
        """A channel to the same server (socket, bearer token, call token) for coroutines of
        another event loop, connecting on its first call, queueing none (``queue=False``).
        ``hop(awaitable)`` awaits one of this channel's coroutines on this channel's loop:
        the sibling learns a restarted server through this channel's relearn."""
        sibling = AsyncCallChannel(self.path, None, self._call_token, None, max_connections, queue=False)
        sibling._hello = self._hello
        relearn = self._relearn
        if relearn is not None:
            sibling._relearn = lambda: hop(relearn())
        return sibling

    @property
    def usable(self) -> bool:
        """False while the socket is known not to take calls (gRPC then, without trying it)."""
        return not self._retired and asyncio.get_running_loop().time() >= self._down_until

    async def call(self, method: str, request: Any, timeout_s: float) -> Any:
        """Calls ``method`` ("Service.Method" of frames.METHODS) and returns its response.
        Raises the server's error as its KVStoreError, NotSent when the request did not reach
        the server, TimeoutError past ``timeout_s`` (what the call granted is given back)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        frame = frames.request_frame(frames.METHOD_IDS[method], frames.timeout_ms(timeout_s), request.SerializeToString())
        if not self._queue and self._slots.locked():
            raise NotSent(f"call socket {self.path}: all connections of this loop busy")
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        except TimeoutError:
            raise NotSent(f"call socket {self.path}: all {MAX_CONNECTIONS} connections busy") from None
        try:
            return await self._call(loop, method, frame, deadline)
        except NotSent:
            self._down_until = loop.time() + _RETRY_S
            raise
        finally:
            self._slots.release()

    async def _call(self, loop: asyncio.AbstractEventLoop, method: str, frame: bytes, deadline: float) -> Any:
        for attempt in range(2):
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else await self._connect(min(deadline, loop.time() + _HELLO_S))
            received = bytearray()  # of the answer: what a deadline leaves read is still looked at
            sent = False
            try:
                async with asyncio.timeout_at(deadline):
                    await loop.sock_sendall(conn, frame)
                    sent = True
                    status, body = await _answer(loop, conn, received)
            except (TimeoutError, asyncio.CancelledError):
                if sent:
                    self._abandon(conn, method, received)
                else:
                    conn.close()  # a request cut short is never run
                raise
            except (_Gone, OSError) as exc:
                conn.close()
                if reused and not received and attempt == 0:
                    self._drop_idle()  # the others, idle as long, are as likely closed
                    continue  # the server had closed this idle connection (a restart): a new one
                if not sent:
                    raise NotSent(f"call socket {self.path}: {exc}") from None
                raise KVStoreError(f"call socket {self.path}: {exc}") from None
            if status == UNAUTHENTICATED or self._retired:
                conn.close()  # the server closes a connection whose caller it refused; a retired channel keeps none
            else:
                self._idle.append(conn)
            if status == 0:
                return _response_type(method).FromString(body)
            raise answer_error(status, body)
        raise AssertionError("unreachable")

    async def _connect(self, deadline: float) -> socket.socket:
        """A connection that said HELLO; NotSent when there is none to be had by ``deadline``."""
        loop = asyncio.get_running_loop()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.setblocking(False)
        try:
            async with asyncio.timeout_at(deadline):
                await loop.sock_connect(conn, self.path)
                check_served_by_us(conn, self.path)  # before the HELLO: it carries the token
                await loop.sock_sendall(conn, self._hello)
                status, body = await _answer(loop, conn, bytearray())
        except (TimeoutError, OSError, _Gone, KVStoreError) as exc:
            conn.close()  # nothing was asked yet: nothing to give back
            raise NotSent(f"call socket {self.path}: {exc or 'no HELLO answer by the deadline'}") from None
        except BaseException:
            conn.close()
            raise
        if status != 0:
            conn.close()
            raise NotSent(f"call socket {self.path}: HELLO refused: {frames.parse_error(body)[1]}")
        if body[: frames.CALL_TOKEN_BYTES] != self._call_token:
            conn.close()
            try:
                async with asyncio.timeout_at(deadline):  # asking the server again is part of this call
                    learnt = await self._learn()
            except TimeoutError:
                raise NotSent(f"call socket {self.path}: the restarted server's socket not learnt by the deadline") from None
            if learnt:
                return await self._connect(deadline)  # once: _learn asks again only after RELEARN_S
            raise NotSent(f"call socket {self.path} belongs to another server now; unary calls go over gRPC")
        return conn

    async def _learn(self) -> bool:
        """After a HELLO answered with another call token (the server restarted): True when
        the server, asked over gRPC, names another socket or token now (taken from here on).
        At most once every RELEARN_S; meanwhile ``call`` raises NotSent (gRPC)."""
        loop = asyncio.get_running_loop()
        if self._relearn is None or loop.time() < self._learn_after:
            return False
        self._learn_after = loop.time() + RELEARN_S
        taken = take_over(await self._relearn(), self.path, self._call_token, self._idle, "the async client's unary calls")
        if taken is None:
            return False
        self.path, self._call_token = taken
        return True

    def _abandon(self, conn: socket.socket, method: str, received: bytearray) -> None:
        """After a deadline or a cancel: from the shutdown on the server cannot deliver the
        answer (and undoes it); one delivered before is read here and given back."""
        undo = drain_late(conn, method, received)
        if undo is None:
            return
        undo_method, request = undo
        self.num_late += 1
        task = asyncio.get_running_loop().create_task(self._give_back(method, undo_method, request))
        self._give_backs.add(task)
        task.add_done_callback(self._give_backs.discard)

    async def _give_back(self, method: str, undo_method: str, request: Any) -> None:
        try:
            await self.call(undo_method, request, GIVE_BACK_S)
        except (KVStoreError, TimeoutError) as exc:
            logger.warning("%s answered late and could not be given back (it expires): %s", method, exc)

    async def close(self) -> None:
        """Waits (bounded) for the give-backs still running, then closes the connections."""
        if self._give_backs:
            await asyncio.wait(list(self._give_backs), timeout=2 * GIVE_BACK_S)
        self.retire()

    def _drop_idle(self) -> None:
        """Closes the idle connections, so that a retry connects anew: before, it took the next
        idle one, and a restart's second dead one made the call NotSent (gRPC for _RETRY_S)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def retire(self) -> None:
        """gRPC from here on: closes the idle connections (one in use closes once its call ends).
        On the channel's loop, or once that loop runs no more."""
        self._retired = True
        self._drop_idle()


def _response_type(method: str) -> Any:
    service, name = method.split(".", 1)
    return getattr(directory_pb2 if service == "Directory" else data_pb2, name + "Response")


async def _answer(loop: asyncio.AbstractEventLoop, conn: socket.socket, received: bytearray) -> tuple[int, bytes]:
    """One answer frame (status, body), its bytes gathered in ``received`` (a cancel loses none)."""
    size = frames.ANSWER_HEADER.size
    await _fill(loop, conn, received, size)
    body_bytes, status = frames.ANSWER_HEADER.unpack(received[:size])
    if body_bytes > frames.MAX_ANSWER_BYTES:
        raise _Gone(f"an answer of {body_bytes} bytes")
    await _fill(loop, conn, received, size + body_bytes)
    return status, bytes(received[size:])


async def _fill(loop: asyncio.AbstractEventLoop, conn: socket.socket, received: bytearray, num_bytes: int) -> None:
    # recv here, not loop.sock_recv: a cancel landing between its recv and our resumption would drop the bytes
    while len(received) < num_bytes:
        try:
            chunk = conn.recv(num_bytes - len(received))
        except BlockingIOError:
            await _readable(loop, conn)
            continue
        if not chunk:
            raise _Gone("the server closed the connection")
        received += chunk


async def _readable(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    ready = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)
