"""Blocking unary calls over the call socket from a thread of the caller's (README.md): no gRPC,
no event-loop hop. The vLLM connector's hit path (lookup+lease, release) takes it.

Thread-safe: a call takes an idle connection (or opens one) and puts it back after its answer.
Nothing left behind: past its deadline a call shuts the connection's reading side first (the
server then undoes what it could not deliver), then gives back an answer that had arrived.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvstore._proto import data_pb2
from kvstore.callsocket import frames
from kvstore.errors import KVStoreError
from kvstore.security.socket_owner import check_served_by_us
from kvstore.status import error_for

logger = logging.getLogger(__name__)

# Public, shared with the asyncio channel (client_aio.py):
UNAUTHENTICATED = int(grpc.StatusCode.UNAUTHENTICATED.value[0])  # the status after which the server closes the connection
GIVE_BACK_S = 0.2  # a late answer's give-back blocks its caller this long at most (to connect; it expires otherwise)
RELEARN_S = 1.0  # after a restart, the new server's call token is asked for at most this often
_CODES = {int(code.value[0]): code for code in grpc.StatusCode}
# What asks the server over gRPC, within the seconds given, for (its call socket, its call token) now;
# None when it cannot be asked (from the client's runtime thread, or it failed) or offers no socket.
Relearn = Callable[[float], "tuple[str, bytes] | None"]
# What gives back the result of a call that was answered after its caller stopped waiting.
_GIVE_BACK = {
    "Data.Acquire": lambda answer: ("Data.Release", data_pb2.ReleaseRequest(lease_id=answer.lease_id)),
    "Data.Allocate": lambda answer: ("Data.Abort", data_pb2.AbortRequest(allocation_id=answer.allocation_id)),
}


class CallChannel:
    """The client side; ``open`` makes one, or None when this host cannot use the server's socket."""

    def __init__(self, path: str, token: str | None, call_token: bytes, timeout_s: float,
                 relearn: Relearn | None = None, check_process: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.tenant = ""
        self._hello = frames.request_frame(frames.HELLO, 0, (token or "").encode())
        self._call_token = call_token
        self._relearn = relearn
        self._learn_after = 0.0  # no new call token is asked for before this (time.monotonic)
        self._idle: list[socket.socket] = []
        self._owed: dict[socket.socket, int] = {}  # answers of posted calls still to read, per idle connection
        self._lock = threading.Lock()
        self._closed = False
        self.num_late = 0  # answers that came after their deadline and were given back here
        self._check_process = check_process  # raises in a forked child (the client's ProcessCheck.check)

    @classmethod
    def open(cls, path: str, token: str | None, call_token: bytes, timeout_s: float,
             relearn: Relearn | None = None, check_process: Callable[[str], None] | None = None) -> CallChannel | None:
        """A channel whose first connection said HELLO; None (reason logged) when the socket
        is not reachable (another host, another uid), not this server's, or the token refused.
        ``relearn(timeout_s)`` asks the server over gRPC for its call socket and call token
        now: after a restart the channel takes the new server's socket (see ``_learn``).
        ``check_process(path)`` raises in a forked child before any call touches a connection."""
        if not path or len(call_token) != frames.CALL_TOKEN_BYTES:
            return None
        channel = cls(path, token, call_token, timeout_s, relearn, check_process)
        try:
            channel._put(channel._connect(time.monotonic() + min(timeout_s, 2.0)))
        except (KVStoreError, TimeoutError) as exc:  # TimeoutError: no HELLO answer (a stalled server, a stranger's socket)
            logger.info("call socket %s not usable (%s); unary calls go over gRPC", path, exc)
            return None
        return channel

    def call(self, method: str, request: Any, response_type: Any, timeout_s: float | None = None) -> Any:
        """Calls ``method`` ("Service.Method" of frames.METHODS) and blocks this thread for
        the answer, at most ``timeout_s`` (by default the client's). Raises the server's error
        as its KVStoreError, a plain KVStoreError when the socket fails, TimeoutError past the
        deadline (what the call would have given is given back, see ``_abandon``)."""
        if self._check_process is not None:
            self._check_process(self.path)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        frame = frames.request_frame(frames.METHOD_IDS[method], frames.timeout_ms(timeout_s), request.SerializeToString())
        for attempt in range(2):
            conn, reused, owed = self._take(deadline)
            try:
                self._drop_answers(conn, owed, deadline)
            except TimeoutError:
                conn.close()  # this call was not sent yet
                raise TimeoutError(f"no answer from the call socket {self.path} within {timeout_s:.3f} s") from None
            except (_Gone, OSError) as exc:
                conn.close()
                if attempt == 0:
                    self._drop_idle()
                    continue  # this call was not sent yet: on a new connection
                raise KVStoreError(f"call socket {self.path}: {exc}") from None
            received = bytearray()  # of the answer: what a deadline leaves read is still looked at
            try:
                conn.settimeout(max(1e-6, deadline - time.monotonic()))
                conn.sendall(frame)
                status, body = _answer(conn, deadline, received)
            except TimeoutError:
                self._abandon(conn, method, received)
                raise TimeoutError(f"no answer from the call socket {self.path} within {timeout_s:.3f} s") from None
            except (_Gone, BrokenPipeError, ConnectionResetError) as exc:
                conn.close()
                if reused and not received and attempt == 0:
                    self._drop_idle()
                    continue  # the server had closed this idle connection: the request was never read, never ran
                raise KVStoreError(f"call socket {self.path}: {exc}") from None
            except OSError as exc:
                conn.close()
                raise KVStoreError(f"call socket {self.path}: {exc}") from None
            if status == UNAUTHENTICATED:
                conn.close()  # the server closes a connection whose caller it refused
            else:
                self._put(conn)
            if status == 0:
                return response_type.FromString(body)
            raise answer_error(status, body)
        raise AssertionError("unreachable")

    def post(self, method: str, request: Any, timeout_s: float) -> None:
        """Sends a call whose answer nobody waits for (a give-back such as Release: what it
        gives back expires anyway if it fails); the next call on the connection reads and
        drops the answer. Blocks at most ``timeout_s`` (a connection to open, a full socket);
        raises KVStoreError or TimeoutError when the call was not sent."""
        deadline = time.monotonic() + timeout_s
        frame = frames.request_frame(frames.METHOD_IDS[method], frames.timeout_ms(self.timeout_s),
                                        request.SerializeToString())
        conn, _, owed = self._take(deadline)
        try:
            conn.settimeout(max(1e-6, deadline - time.monotonic()))
            conn.sendall(frame)
        except OSError as exc:  # TimeoutError included: a part may have gone, the connection cannot be reused
            conn.close()
            raise KVStoreError(f"call socket {self.path}: {method} not sent: {exc}") from None
        self._put(conn, owed + 1)

    def _drop_answers(self, conn: socket.socket, owed: int, deadline: float) -> None:
        """Reads the answers of ``owed`` posted calls (a failure is logged: what they gave back expires)."""
        for _ in range(owed):
            status, body = _answer(conn, deadline, bytearray())
            if status != 0:
                logger.info("a call posted on the call socket failed (what it gave back expires): %s",
                            frames.parse_error(body)[1])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._owed.clear()
        for conn in idle:
            conn.close()

    # -- connections -----------------------------------------------------------------------

    def _take(self, deadline: float) -> tuple[socket.socket, bool, int]:
        """A connection for one call: (it, whether it was used before, answers owed on it)."""
        with self._lock:
            if self._closed:
                raise KVStoreError(f"the call channel to {self.path} is closed")
            if self._idle:
                conn = self._idle.pop()
                return conn, True, self._owed.pop(conn, 0)
        return self._connect(deadline), False, 0

    def _drop_idle(self) -> None:
        """Closes every idle connection: one was found closed by the server (a restart, its idle
        timeout), and the others, idle as long, are as likely closed, so the retry connects anew
        (before: it took the next idle one, and a restart's second dead one failed the call)."""
        with self._lock:
            idle, self._idle = self._idle, []
            for conn in idle:
                self._owed.pop(conn, None)  # the answers of give-backs posted on them: they expire
        for conn in idle:
            conn.close()

    def _put(self, conn: socket.socket, owed: int = 0) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                if owed:
                    self._owed[conn] = owed
                return
        conn.close()

    def _connect(self, deadline: float) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(max(1e-3, deadline - time.monotonic()))
            conn.connect(self.path)
            check_served_by_us(conn, self.path)  # the HELLO carries the token
            conn.sendall(self._hello)
            status, body = _answer(conn, deadline, bytearray())
        except TimeoutError:
            conn.close()  # nothing was asked yet: nothing to give back
            raise TimeoutError(f"call socket {self.path}: no HELLO answer by the deadline") from None
        except (OSError, _Gone) as exc:
            conn.close()
            raise KVStoreError(f"call socket {self.path}: {exc}") from None
        except KVStoreError:
            conn.close()  # not our server's uid: nothing was sent
            raise
        if status != 0:
            conn.close()
            raise answer_error(status, body)
        if body[: frames.CALL_TOKEN_BYTES] != self._call_token:
            conn.close()
            if self._learn(deadline):
                return self._connect(deadline)  # the new server; another restart meanwhile: asked again at most once per RELEARN_S, within the deadline
            raise KVStoreError(f"call socket {self.path} belongs to another server")
        self.tenant = body[frames.CALL_TOKEN_BYTES :].decode(errors="replace")
        return conn

    def _learn(self, deadline: float) -> bool:
        """After a HELLO answered with another call token (the server restarted): True when
        the server, asked over gRPC, names another socket or token now (taken from here on).
        At most once every RELEARN_S: a stranger's socket costs one gRPC call a second; a call
        that finds the last ask too recent waits for its turn if that comes before its deadline
        (a server restarted twice within RELEARN_S is reached, not refused)."""
        while True:
            now = time.monotonic()
            with self._lock:
                if self._relearn is None:
                    return False
                wait = self._learn_after - now
                if wait <= 0:
                    self._learn_after = now + RELEARN_S
                    break
            if now + wait >= deadline:
                return False
            time.sleep(wait)
        learnt = self._relearn(max(1e-3, deadline - now))
        with self._lock:
            taken = take_over(learnt, self.path, self._call_token, self._idle, "unary calls")
            if taken is None:
                return False
            self.path, self._call_token = taken
            self._owed.clear()  # of the old server's connections, closed
        return True

    def _abandon(self, conn: socket.socket, method: str, received: bytearray) -> None:
        """After a deadline: from the shutdown on the server cannot deliver the answer (and
        undoes it); one delivered before (``received``: what the call read of it) is read
        here and given back."""
        undo = drain_late(conn, method, received)
        if undo is None:
            return
        undo_method, request = undo
        self.num_late += 1
        try:  # posted: the caller's deadline has passed, it waits for no answer (a failed one is logged later)
            self.post(undo_method, request, GIVE_BACK_S)
        except (KVStoreError, TimeoutError) as exc:
            logger.warning("%s answered late and could not be given back (it expires): %s", method, exc)


class _Gone(Exception):
    """The server closed the connection (or sent what no answer is)."""


def _answer(conn: socket.socket, deadline: float, received: bytearray) -> tuple[int, bytes]:
    """One answer frame (status, body), its bytes gathered in ``received``; TimeoutError at
    ``deadline``, _Gone when the server closes the connection."""
    size = frames.ANSWER_HEADER.size
    _fill(conn, received, size, deadline)
    body_bytes, status = frames.ANSWER_HEADER.unpack(received[:size])
    if body_bytes > frames.MAX_ANSWER_BYTES:
        raise _Gone(f"an answer of {body_bytes} bytes")
    _fill(conn, received, size + body_bytes, deadline)
    return status, bytes(received[size:])


def _fill(conn: socket.socket, received: bytearray, num_bytes: int, deadline: float) -> None:
    while len(received) < num_bytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        conn.settimeout(left)
        chunk = conn.recv(num_bytes - len(received))
        if not chunk:
            raise _Gone("the server closed the connection")
        received += chunk


def take_over(learnt: tuple[str, bytes] | None, path: str, call_token: bytes, idle: list[socket.socket],
              what: str) -> tuple[str, bytes] | None:
    """The take-over part of both call channels' ``_learn`` (the asking and waiting are each
    their own): when what a relearn brought names a socket or call token other than
    (``path``, ``call_token``), the old server's ``idle`` connections are closed and removed
    from it (the caller holds what guards it) and the new (socket, call token) is returned;
    else None, nothing changed."""
    if learnt is None or len(learnt[1]) != frames.CALL_TOKEN_BYTES or learnt == (path, call_token):
        return None
    for conn in idle:
        conn.close()  # the old server's
    idle.clear()
    logger.info("call socket %s: the server restarted; %s go to the new one", path, what)
    return learnt


def answer_error(status: int, body: bytes) -> KVStoreError:
    """The KVStoreError of an error answer (``status`` not 0): the class the server named,
    else the one of its gRPC status, as a gRPC call would raise it."""
    name, message = frames.parse_error(body)
    return error_for(_CODES.get(status, grpc.StatusCode.UNKNOWN), message, name or None)


def _response_type(method: str) -> Any:
    return getattr(data_pb2, method.split(".", 1)[1] + "Response")


def drain_late(conn: socket.socket, method: str, received: bytearray) -> tuple[str, Any] | None:
    """After a deadline: shuts ``conn``'s reading side (the server's write of the answer fails
    from then on, and it undoes the call), reads what had arrived, closes it, and returns the
    give-back of an answer that came whole (``late_give_back``). Both channels' abandon."""
    data = bytes(received)
    try:
        conn.shutdown(socket.SHUT_RD)
        conn.setblocking(False)
        while chunk := conn.recv(1 << 20):
            data += chunk
    except OSError:
        pass  # BlockingIOError: all that arrived is read
    finally:
        conn.close()
    return late_give_back(method, data)


def late_give_back(method: str, data: bytes) -> tuple[str, Any] | None:
    """The call that undoes a late answer read after a deadline (Release for an Acquire's
    lease, Abort for an Allocate), or None: no whole OK answer arrived (the server's write
    failed, and it undid the call itself) or the method leaves nothing behind. Shared by the
    blocking and the asyncio channels."""
    size = frames.ANSWER_HEADER.size
    if len(data) < size:
        return None
    body_bytes, status = frames.ANSWER_HEADER.unpack(data[:size])
    give_back = _GIVE_BACK.get(method)
    if status != 0 or give_back is None or len(data) < size + body_bytes:
        return None
    return give_back(_response_type(method).FromString(data[size : size + body_bytes]))
