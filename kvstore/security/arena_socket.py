"""A tenant's shared-memory arena (issue 16, item 4; tiers/arenas.py) handed to an
authenticated same-host client as a file descriptor over a Unix socket (SCM_RIGHTS): the
arena has no path anyone could open.

Protocol, one exchange per connection (each message: 4-byte big-endian length + JSON):

    client -> server   {"token": "<bearer token>"}            (no token: only without --auth-file)
    server -> client   {"ok": true, "tenant": "...", "size_bytes": N}  + the arena's fd (SCM_RIGHTS)
                    or {"ok": false, "error": "..."}              and no fd

The request names no tenant and no arena: the token decides whose arena comes back, so a
caller can only ever receive its own tenant's. The socket is 0600 in the 0700 data
directory (only the server's uid, or root, can connect) and the peer's pid/uid
(SO_PEERCRED) is logged with every hand-out. A peer that has not sent its whole request within
``timeout_s`` is dropped; at most ``max_peers`` exchanges run at once, more are closed unanswered.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore import errors
from kvstore.errors import ConfigError, InvalidRequest, KVStoreError
from kvstore.security.authenticator import Authenticator
from kvstore.security.identity import Identity

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8192
_LENGTH = struct.Struct(">I")
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path, less the terminating NUL

ArenaLookup = Callable[[Identity], "tuple[int, int] | None"]  # identity -> (fd, size_bytes), or None: no arena


def _send(sock: socket.socket, doc: dict[str, Any], fds: list[int] | None = None) -> None:
    body = json.dumps(doc).encode()
    message = _LENGTH.pack(len(body)) + body
    sent = socket.send_fds(sock, [message], fds) if fds else sock.send(message)
    if sent < len(message):
        sock.sendall(message[sent:])


def _recv_exact(sock: socket.socket, num_bytes: int, deadline: float | None = None) -> bytes:
    """``num_bytes`` from ``sock``; with ``deadline`` (time.monotonic()), all of them by then:
    a socket timeout bounds each recv, and a peer dripping a byte at a time would pass it."""
    data = b""
    while len(data) < num_bytes:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the peer did not send its message in time")
            sock.settimeout(left)
        chunk = sock.recv(num_bytes - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection mid-message")
        data += chunk
    return data


def _decode(header: bytes, sock: socket.socket, deadline: float | None = None) -> dict[str, Any]:
    (length,) = _LENGTH.unpack(header)
    if length > MAX_MESSAGE_BYTES:
        raise InvalidRequest(f"message of {length} bytes; at most {MAX_MESSAGE_BYTES}")
    try:
        doc = json.loads(_recv_exact(sock, length, deadline))
    except ValueError as exc:
        raise InvalidRequest(f"the message is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest("the message must be a JSON object")
    return doc


class ArenaSocket:
    """The server side. ``arena_for(identity)`` gives the fd and size of the caller's
    tenant's arena (the fd stays the server's: the kernel duplicates it into the peer)."""

    def __init__(self, path: Path, authenticator: Authenticator, arena_for: ArenaLookup, *,
                 timeout_s: float = 2.0, max_peers: int = 8) -> None:
        if len(os.fsencode(path)) > _SUN_PATH_MAX:
            raise ConfigError(f"{path}: a Unix socket path is at most {_SUN_PATH_MAX} bytes; use a shorter --data-dir")
        self.path = path
        self._authenticator = authenticator
        self._arena_for = arena_for
        self._timeout_s = timeout_s
        self._peers = threading.BoundedSemaphore(max_peers)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def start(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a socket file left by a killed server
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.path))
        os.chmod(self.path, 0o600)  # bind used the umask; the 0700 directory covers the moment between
        sock.listen(64)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, name="arena-socket", daemon=True)
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
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closing.is_set():
                    return
                logger.exception("arena socket: accept failed")
                continue
            if not self._peers.acquire(blocking=False):
                conn.close()  # too many exchanges at once: a slow peer must not queue the others
                continue
            threading.Thread(target=self._serve, args=(conn,), name="arena-peer", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self._timeout_s)
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            try:
                identity, fd, size = self._answer(conn)
            except KVStoreError as exc:
                logger.info("arena socket: refused pid %d uid %d: %s", pid, uid, exc)
                _send(conn, {"ok": False, "error": str(exc), "error_class": type(exc).__name__})
                return
            _send(conn, {"ok": True, "tenant": identity.tenant, "size_bytes": size}, [fd])
            logger.info("arena socket: gave tenant %s's arena to pid %d uid %d", identity.tenant, pid, uid)
        except OSError as exc:  # the peer left or stalled: nothing was handed out
            logger.info("arena socket: exchange dropped: %s", exc)
        finally:
            self._peers.release()  # before the close: a peer that saw its connection end finds its slot free
            conn.close()

    def _answer(self, conn: socket.socket) -> tuple[Identity, int, int]:
        deadline = time.monotonic() + self._timeout_s  # for the whole request, not per recv
        request = _decode(_recv_exact(conn, _LENGTH.size, deadline), conn, deadline)
        token = request.get("token")
        if token is not None and not isinstance(token, str):
            raise InvalidRequest("token must be a string")
        identity = self._authenticator.authenticate([f"Bearer {token}"] if token else [], None)
        arena = self._arena_for(identity)
        if arena is None:
            raise KVStoreError(f"tenant {identity.tenant!r} has no arena on this server")
        return identity, arena[0], arena[1]


def receive_arena(path: Path, token: str | None, timeout_s: float = 5.0) -> tuple[int, int, str]:
    """The client side: (fd, size_bytes, tenant) of this token's arena. The caller owns the
    fd (mmap it, then close it). Raises the server's error class (Unauthenticated for a
    refused token), or KVStoreError for a broken exchange."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
            _send(sock, {"token": token} if token is not None else {})
            data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES + _LENGTH.size, 1)
        except OSError as exc:
            raise KVStoreError(f"arena socket {path}: {exc}") from None
        try:
            if flags & socket.MSG_CTRUNC:
                raise KVStoreError(f"arena socket {path}: more file descriptors than expected")
            if len(data) < _LENGTH.size:
                raise KVStoreError(f"arena socket {path}: no answer")
            (length,) = _LENGTH.unpack(data[:_LENGTH.size])
            body = data[_LENGTH.size:]
            if length > MAX_MESSAGE_BYTES:
                raise KVStoreError(f"arena socket {path}: answer of {length} bytes")
            body += _recv_exact(sock, length - len(body)) if len(body) < length else b""
            answer = json.loads(body)
            if not answer.get("ok"):
                kind = getattr(errors, str(answer.get("error_class")), None)
                if not (isinstance(kind, type) and issubclass(kind, KVStoreError)):
                    kind = KVStoreError
                raise kind(f"arena socket {path}: {answer.get('error', 'refused')}")
            if len(fds) != 1:
                raise KVStoreError(f"arena socket {path}: the answer carried no file descriptor")
            fd = fds.pop()
            return fd, int(answer["size_bytes"]), str(answer["tenant"])
        except (ValueError, KeyError, OSError) as exc:
            raise KVStoreError(f"arena socket {path}: bad answer: {exc}") from None
        finally:
            for stray in fds:
                os.close(stray)
