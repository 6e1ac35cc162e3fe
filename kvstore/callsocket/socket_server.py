"""The call socket's server (README.md; DESIGN §11): accepts on a 0600 Unix socket, serves each
connection on a thread of its own (HELLO with the bearer token first, then one request after the
other) with the very same guarded handlers as gRPC and a LocalContext for grpc.ServicerContext.
Limits: connections in all, per peer process and per tenant; HELLO, idle and frame timeouts. An
answer that cannot be delivered is undone (``undo``: Acquire's lease released, Allocate aborted).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from kvstore.accept_pause import AcceptPause
from kvstore.callsocket import frames
from kvstore.callsocket.context import Aborted, LocalContext
from kvstore.callsocket.server_conn import Close, FrameConn
from kvstore.errors import Unauthenticated
from kvstore.logs import Throttled
from kvstore.security.authenticator import Authenticator
from kvstore.security.identity import Identity
from kvstore.security.interceptor import AuthenticatedCall
from kvstore.unix_paths import check_socket_path

logger = logging.getLogger(__name__)

_MAX_HELLO_BYTES = 4096
_DEFAULT_TIMEOUT_S = 30.0  # a request that names no deadline (timeout_ms 0)
_peer_errors = Throttled(logger)
Undo = Callable[[Any, Identity], None]  # (the response that was not delivered, its caller)


def _status(code: grpc.StatusCode) -> int:
    return int(code.value[0])


class TenantConnections:
    """The call socket's connections past HELLO per tenant with a call_connections limit. Made before the
    quotas, which read it (``held``: their usage), and handed to the call socket, which counts. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def held(self, tenant: str) -> int:
        with self._lock:
            return self._held.get(tenant, 0)

    def claim(self, tenant: str, limit: int) -> bool:
        """Counts one more connection of ``tenant``; False (nothing counted) when it holds ``limit`` already."""
        with self._lock:
            held = self._held.get(tenant, 0)
            if held >= limit:
                return False
            self._held[tenant] = held + 1
            return True

    def release(self, tenant: str) -> None:
        with self._lock:
            self._held[tenant] -= 1


class CallSocket:
    """Serves ``handlers`` (full name "Service.Method" -> the guarded grpc handler) for the
    methods of ``frames.METHODS``. ``rejected(method, code)`` counts refused callers."""

    def __init__(self, path: Path, authenticator: Authenticator, handlers: dict[str, grpc.RpcMethodHandler],
                 call_token: bytes, *, undo: dict[str, Undo] | None = None,
                 rejected: Callable[[str, str], None] | None = None, tenant_limit: Callable[[Identity], int] | None = None,
                 quota_refused: Callable[[str], None] | None = None, connections: TenantConnections | None = None,
                 max_connections: int = 256,
                 max_per_pid: int = 32, hello_timeout_s: float = 2.0, idle_timeout_s: float = 300.0, frame_timeout_s: float = 2.0) -> None:
        check_socket_path(path)
        self._table: list[tuple[str, grpc.RpcMethodHandler] | None] = [None]
        for name in frames.METHODS:
            handler = handlers[name]
            if handler.request_streaming or handler.response_streaming:
                raise RuntimeError(f"{name} streams: the call channel serves unary methods only")
            self._table.append((name, handler))
        self.path = path
        self.call_token = call_token
        self._authenticator = authenticator
        self._undo = undo or {}
        self._rejected = rejected
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_per_pid = max_per_pid
        self._per_pid: dict[int, int] = {}  # open connections per peer process
        self._tenant_limit, self._quota_refused = tenant_limit, quota_refused  # a tenant's call_connections, its refusals
        self._connections = connections or TenantConnections()  # connections past HELLO per tenant (those with a limit)
        self._hello_s, self._idle_s, self.frame_timeout_s = hello_timeout_s, idle_timeout_s, frame_timeout_s
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self.accept_pause = AcceptPause(logger, "call socket")  # out of descriptors: a pause between accepts
        self._open: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a socket file left by a killed server (this one holds the directory's lock)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600: no moment in which another uid may connect
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(socket.SOMAXCONN)  # a burst of clients connecting waits here rather than being refused (EAGAIN)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, name="call-socket", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._closing.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
            except OSError:
                pass
            self._sock.close()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            open_now = dict(self._open)
        for conn in open_now:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes its reader; its thread closes it
            except OSError:
                pass
        deadline = time.monotonic() + 5  # one wait for all: 256 slow peers must not stretch a stop to minutes
        for thread in open_now.values():  # a call in progress ends before the tiers close
            thread.join(max(0.0, deadline - time.monotonic()))
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._closing.is_set():
                    return
                self._closing.wait(self.accept_pause.failed(exc))  # EMFILE: a pause, not a spin
                continue
            try:
                pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            except OSError:
                conn.close()
                continue
            with self._lock:  # pid 0: a peer in another pid namespace, not told apart from the others there
                own = pid == 0 or self._per_pid.get(pid, 0) < self._max_per_pid
                if own:
                    self._per_pid[pid] = self._per_pid.get(pid, 0) + 1
            if not own or not self._slots.acquire(blocking=False):
                if own:
                    self._unclaim(pid)
                what = "its maximum of connections" if own else f"{self._max_per_pid} connections to this process"
                try:
                    conn.setblocking(False)
                    conn.send(frames.answer_frame(_status(grpc.StatusCode.RESOURCE_EXHAUSTED), frames.error_body(
                        "LimitExceeded", f"the call socket serves {what} already; use gRPC or retry")))
                except OSError:
                    pass
                conn.close()
                continue
            thread = threading.Thread(target=self._serve, args=(conn, pid, uid), name="call-peer", daemon=True)
            with self._lock:
                self._open[conn] = thread
            try:
                thread.start()
            except RuntimeError as exc:  # "can't start new thread": this peer goes, the socket stays up
                _peer_errors.warning("thread", "call socket: cannot serve pid %d (%s); it falls back to gRPC", pid, exc)
                with self._lock:
                    self._open.pop(conn, None)
                self._slots.release()
                self._unclaim(pid)
                conn.close()

    def _unclaim(self, pid: int) -> None:
        with self._lock:
            left = self._per_pid.pop(pid) - 1
            if left:
                self._per_pid[pid] = left

    # -- one connection --------------------------------------------------------------------

    def _serve(self, conn: socket.socket, pid: int, uid: int) -> None:
        peer = f"unix:pid={pid},uid={uid}"
        tenant: str | None = None  # counted against its call_connections once past HELLO
        link = FrameConn(conn, self.frame_timeout_s)
        try:
            call, authorization = self._hello(link, peer)
            tenant = self._claim_tenant(call.identity)
            link.send(frames.answer_frame(0, self.call_token + call.identity.tenant.encode()))
            while not self._closing.is_set():
                frame = link.read(self._idle_s)
                if frame is None:
                    return  # the peer closed between calls, or stayed idle too long
                if not self._answer(link, call, authorization, peer, *frame):
                    return
        except Close as exc:
            logger.info("call socket: closing %s: %s", peer, exc)
            if exc.code is not None:
                self._send_quietly(link, exc.code, exc.error_class, str(exc))
        except OSError as exc:  # the peer left mid-frame or mid-answer
            logger.debug("call socket: %s dropped: %s", peer, exc)
        finally:
            with self._lock:
                self._open.pop(conn, None)
            if tenant is not None:
                self._connections.release(tenant)
            self._unclaim(pid)
            self._slots.release()  # before the close: a peer that saw its connection end finds its slot free
            conn.close()

    def _hello(self, link: FrameConn, peer: str) -> tuple[AuthenticatedCall, str | None]:
        frame = link.read(self._hello_s, whole_within=self._hello_s, header=self._hello_header)
        if frame is None:
            raise Close(None, "no HELLO")
        _, _, body = frame
        try:
            token = body.decode()
        except UnicodeDecodeError:
            raise Close(grpc.StatusCode.UNAUTHENTICATED, "the token is not UTF-8") from None
        authorization = f"Bearer {token}" if token else None
        try:
            call = AuthenticatedCall(self._authenticator, [authorization] if authorization else [], None)
        except Unauthenticated as exc:
            self._count("HELLO", grpc.StatusCode.UNAUTHENTICATED)
            raise Close(grpc.StatusCode.UNAUTHENTICATED, f"HELLO: {exc}") from None
        except OSError as exc:  # the tenant's salt could not be stored
            raise Close(grpc.StatusCode.UNAVAILABLE, f"HELLO: storage I/O error: {exc}") from None
        logger.info("call socket: %s is tenant %s (%s)", peer, call.identity.tenant, call.identity.via)
        return call, authorization

    def _hello_header(self, method_id: int, body_bytes: int) -> None:
        """The first frame's header: anything but a HELLO that may hold a token is UNAUTHENTICATED,
        before the frame's size is looked at or its body read (DESIGN §11: authentication first)."""
        if method_id != frames.HELLO:
            self._count("HELLO", grpc.StatusCode.UNAUTHENTICATED)
            raise Close(grpc.StatusCode.UNAUTHENTICATED, "the first frame must be HELLO with the bearer token")
        if body_bytes > _MAX_HELLO_BYTES:
            self._count("HELLO", grpc.StatusCode.UNAUTHENTICATED)
            raise Close(grpc.StatusCode.UNAUTHENTICATED, f"HELLO: a token of {body_bytes} bytes; at most {_MAX_HELLO_BYTES}")

    def tenant_connections(self, tenant: str) -> int:
        """The connections past HELLO counted against ``tenant``'s call_connections."""
        return self._connections.held(tenant)

    def _claim_tenant(self, who: Identity) -> str | None:
        """Counts the connection against its tenant's call_connections (None: no limit);
        past the limit the HELLO is refused (LimitExceeded) for that tenant only, so that one
        tenant cannot hold the socket's connections the others need."""
        limit = self._tenant_limit(who) if self._tenant_limit is not None else 0
        if not limit:
            return None
        if self._connections.claim(who.tenant, limit):
            return who.tenant
        if self._quota_refused is not None:
            self._quota_refused(who.tenant)
        raise Close(grpc.StatusCode.RESOURCE_EXHAUSTED, f"tenant {who.tenant!r} holds its {limit} call socket connections "
                     "(call_connections) already; use gRPC or retry", "LimitExceeded")

    def _answer(self, link: FrameConn, call: AuthenticatedCall, authorization: str | None, peer: str,
                method_id: int, timeout_ms: int, body: bytes) -> bool:
        """Answers one request; False when the connection must close."""
        entry = self._table[method_id] if 0 < method_id < len(self._table) else None
        if entry is None:
            what = "HELLO was already said" if method_id == frames.HELLO else f"no method {method_id} on the call socket"
            self._send(link, grpc.StatusCode.UNIMPLEMENTED, "InvalidRequest", f"{what}; use gRPC")
            return True
        name, handler = entry
        method = name.rsplit(".", 1)[-1]
        try:
            call.recheck()
        except Unauthenticated as exc:
            self._count(method, grpc.StatusCode.UNAUTHENTICATED)
            self._send(link, grpc.StatusCode.UNAUTHENTICATED, "Unauthenticated", f"{method}: {exc}")
            return False
        context = LocalContext(peer, authorization, timeout_ms / 1000 if timeout_ms else _DEFAULT_TIMEOUT_S)
        response = None
        try:
            response = call.run(handler.unary_unary, body, context)
            answer = frames.answer_frame(0, handler.response_serializer(response))
        except Aborted as exc:
            answer = frames.answer_frame(_status(exc.code), frames.error_body(context.error_class, exc.details))
        except Exception as exc:  # the handlers map every error: this is a bug, answered and logged
            logger.exception("call socket: %s failed", name)
            answer = frames.answer_frame(_status(grpc.StatusCode.INTERNAL),
                                            frames.error_body("", f"internal error: {type(exc).__name__}"))
        try:
            link.send(answer)  # a caller that does not read its answers holds this thread no longer
        except OSError:
            undo = self._undo.get(method)
            if response is not None and undo is not None:
                logger.info("call socket: %s's answer could not be delivered to %s; undone", method, peer)
                undo(response, call.identity)
            raise
        return True

    def _send(self, link: FrameConn, code: grpc.StatusCode, error_class: str, message: str) -> None:
        link.send(frames.answer_frame(_status(code), frames.error_body(error_class, message)))

    def _send_quietly(self, link: FrameConn, code: grpc.StatusCode, error_class: str, message: str) -> None:
        try:
            link.send(frames.answer_frame(_status(code), frames.error_body(error_class, message)), 0.1)
        except OSError:
            pass

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        if self._rejected is not None:
            self._rejected(method, code.name)
