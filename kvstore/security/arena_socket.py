"""A tenant's shared-memory arena (DESIGN §11 "Same-host paths"; tiers/arenas.py) handed to an
authenticated same-host client as a file descriptor over a Unix socket (SCM_RIGHTS): the
arena has no path anyone could open.

More: kvstore/security/README.md (### arena_socket.py).
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.accept_pause import AcceptPause
from kvstore.device_ops import PoolHandout
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.security.authenticator import Authenticator
from kvstore.security.identity import Identity, Rights
from kvstore.security.socket_owner import check_served_by_us
from kvstore.status import named_error
from kvstore.unix_paths import check_socket_path

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8192
_LENGTH = struct.Struct(">I")
_ACCEPT_BATCH = 64

ArenaLookup = Callable[[Identity], "tuple[int, int] | None"]  # identity -> (fd, size_bytes), or None: no arena
PoolLookup = Callable[[Identity], "PoolHandout | None"]  # identity -> its tenant's hbm pool, or None: no pool


def may_map_pool(identity: Identity) -> bool:
    """Whether ``identity`` may be handed its tenant's hbm pool (and Acquire copy into it)."""
    return identity.allows(Rights.READ) and identity.allows(Rights.WRITE)


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


@dataclass
class _Peer:
    """One accepted connection: who (SO_PEERCRED), until when it may send, what it sent so far."""

    conn: socket.socket
    pid: int
    uid: int
    deadline: float
    received: bytes = field(default=b"")


def _request(received: bytes) -> dict[str, Any] | None:
    """The request in ``received``, or None while it is incomplete; InvalidRequest for a bad one."""
    if len(received) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(received[: _LENGTH.size])
    if length > MAX_MESSAGE_BYTES:
        raise InvalidRequest(f"message of {length} bytes; at most {MAX_MESSAGE_BYTES}")
    if len(received) < _LENGTH.size + length:
        return None
    try:
        doc = json.loads(received[_LENGTH.size : _LENGTH.size + length])
    except ValueError as exc:
        raise InvalidRequest(f"the message is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest("the message must be a JSON object")
    return doc


class ArenaSocket:
    """The server side. ``arena_for(identity)`` gives the fd and size of the caller's
    tenant's arena (the fd stays the server's: the kernel duplicates it into the peer)."""

    def __init__(self, path: Path, authenticator: Authenticator, arena_for: ArenaLookup, *,
                 pool_for: PoolLookup | None = None, timeout_s: float = 2.0, max_peers: int = 256,
                 max_per_pid: int = 32) -> None:
        check_socket_path(path)
        self.path = path
        self._authenticator = authenticator
        self._arena_for = arena_for
        self._pool_for = pool_for
        self._timeout_s = timeout_s
        self._max_peers = max_peers
        self._max_per_pid = max_per_pid
        self._peers: dict[int, _Peer] = {}  # by the connection's fd, in accept order
        self._selector = selectors.DefaultSelector()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self.accept_pause = AcceptPause(logger, "arena socket")  # out of descriptors: accepting pauses, reads go on

    def start(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a socket file left by a killed server
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.path))
        os.chmod(self.path, 0o600)  # bind used the umask; the 0700 directory covers the moment between
        sock.listen(socket.SOMAXCONN)  # a burst of connections waits in the backlog, not refused
        sock.setblocking(False)
        self._sock = sock
        self._selector.register(sock, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="arena-socket", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._closing.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the selector
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()
        self.path.unlink(missing_ok=True)

    def _loop(self) -> None:
        try:
            while not self._closing.is_set():
                now = time.monotonic()
                if self.accept_pause.ended(now):
                    assert self._sock is not None
                    self._selector.register(self._sock, selectors.EVENT_READ)
                for peer in [p for p in self._peers.values() if p.deadline <= now]:
                    logger.info("arena socket: pid %d uid %d sent no request within %.1f s", peer.pid, peer.uid, self._timeout_s)
                    self._drop(peer)
                wait = min([p.deadline for p in self._peers.values()] + [self.accept_pause.until or now + 1.0]) - now
                for key, _ in self._selector.select(max(0.0, min(wait, 1.0))):
                    if key.fileobj is self._sock:
                        self._accept()
                    elif (peer := self._peers.get(key.fd)) is not None:
                        self._read(peer)
        except Exception:  # a bug here must not leave the server silently without arenas
            logger.exception("arena socket: the serving loop failed")
        finally:
            for peer in list(self._peers.values()):
                self._drop(peer)
            self._selector.close()

    def _accept(self) -> None:
        """The connections waiting, each within the per-process and total limits; at most
        _ACCEPT_BATCH a turn: peers reconnecting as fast as they are closed must not keep the
        loop from reading the requests it has accepted."""
        assert self._sock is not None
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if not self._closing.is_set():  # EMFILE: the selector would wake at once
                    self._selector.unregister(self._sock)
                    self.accept_pause.failed(exc)
                return
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            held = [p for p in self._peers.values() if p.pid == pid]
            if len(held) >= self._max_per_pid:
                logger.debug("arena socket: pid %d already holds %d connections; closed a new one", pid, len(held))
                conn.close()
                continue
            if len(self._peers) >= self._max_peers:
                self._drop(self._oldest_of_busiest())
            conn.setblocking(False)
            peer = _Peer(conn, pid, uid, time.monotonic() + self._timeout_s)
            self._peers[conn.fileno()] = peer
            self._selector.register(conn, selectors.EVENT_READ)

    def _oldest_of_busiest(self) -> _Peer:
        by_pid: dict[int, list[_Peer]] = {}
        for peer in self._peers.values():  # accept order: each list starts with its oldest
            by_pid.setdefault(peer.pid, []).append(peer)
        return max(by_pid.values(), key=len)[0]

    def _drop(self, peer: _Peer) -> None:
        self._peers.pop(peer.conn.fileno(), None)
        try:
            self._selector.unregister(peer.conn)
        except (KeyError, ValueError):
            pass
        peer.conn.close()

    def _read(self, peer: _Peer) -> None:
        try:
            chunk = peer.conn.recv(MAX_MESSAGE_BYTES + _LENGTH.size - len(peer.received))
        except BlockingIOError:
            return
        except OSError as exc:
            logger.info("arena socket: exchange with pid %d dropped: %s", peer.pid, exc)
            self._drop(peer)
            return
        if not chunk:
            self._drop(peer)  # the peer left before its request was whole: nothing was handed out
            return
        peer.received += chunk
        try:
            request = _request(peer.received)
            if request is None:
                return
            self._serve(peer, request)
        except OSError as exc:  # the peer left, or its receive buffer is full: nothing was handed out
            logger.info("arena socket: exchange with pid %d dropped: %s", peer.pid, exc)
        except KVStoreError as exc:
            logger.info("arena socket: refused pid %d uid %d: %s", peer.pid, peer.uid, exc)
            try:
                _send(peer.conn, {"ok": False, "error": str(exc), "error_class": type(exc).__name__})
            except OSError:
                pass
        except Exception:  # a bug answering one peer must not end the loop that serves all of them
            logger.exception("arena socket: exchange with pid %d failed", peer.pid)
        self._drop(peer)

    def _serve(self, peer: _Peer, request: dict[str, Any]) -> None:
        token = request.get("token")
        if token is not None and not isinstance(token, str):
            raise InvalidRequest("token must be a string")
        identity = self._authenticator.authenticate([f"Bearer {token}"] if token else [], None)
        if request.get("want", "arena") == "pool":
            self._serve_pool(peer, identity)
            return
        arena = self._arena_for(identity)
        if arena is None:
            raise KVStoreError(f"tenant {identity.tenant!r} has no arena on this server")
        writable = identity.allows(Rights.WRITE)
        # A reader gets a descriptor of its own, opened read-only: the kernel refuses it a writable mapping.
        fd = arena[0] if writable else os.open(f"/proc/self/fd/{arena[0]}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _send(peer.conn, {"ok": True, "tenant": identity.tenant, "size_bytes": arena[1], "writable": writable}, [fd])
        finally:
            if fd != arena[0]:
                os.close(fd)
        logger.info("arena socket: gave tenant %s's arena (%s) to pid %d uid %d", identity.tenant,
                    "read-write" if writable else "read-only", peer.pid, peer.uid)


    def _serve_pool(self, peer: _Peer, identity: Identity) -> None:
        """Hands ``identity``'s tenant its hbm pool: a CUDA IPC handle in the answer, or the
        pool's descriptor (the CPU implementation)."""
        if not may_map_pool(identity):
            raise KVStoreError("a device pool goes only to a token with read and write (a pool is mapped writable); "
                               "this one reads through its arena")
        pool = self._pool_for(identity) if self._pool_for is not None else None
        if pool is None:
            raise KVStoreError("this server has no hbm pool (--tiers hbm)")
        _send(peer.conn, {"ok": True, "tenant": identity.tenant, "size_bytes": pool.size_bytes, "writable": True,
                          "device": pool.device, "pool_token": pool.token.hex(), "handle": pool.handle},
              [pool.fd] if pool.fd >= 0 else None)
        logger.info("arena socket: gave tenant %s's hbm pool on %s to pid %d uid %d", identity.tenant, pool.device,
                    peer.pid, peer.uid)


def _connect(sock: socket.socket, path: Path, deadline: float) -> None:
    """A full listen backlog answers EAGAIN at once (AF_UNIX does not wait in a socket with a
    timeout): a burst of other connections is waited out until ``deadline``, not taken as a refusal."""
    while True:
        try:
            sock.connect(str(path))
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.002)




def receive_arena(path: Path, token: str | None, timeout_s: float = 5.0) -> tuple[int, int, str]:
    """The client side: (fd, size_bytes, tenant) of this token's arena. The caller owns the
    fd (mmap it, then close it). Raises the server's error class (Unauthenticated for a
    refused token), or KVStoreError for a broken exchange."""
    answer, fd = _exchange(path, {"token": token} if token is not None else {}, timeout_s)
    if fd is None:
        raise KVStoreError(f"arena socket {path}: the answer carried no file descriptor")
    return fd, int(answer["size_bytes"]), str(answer["tenant"])


def receive_pool(path: Path, token: str | None, timeout_s: float = 5.0) -> tuple[PoolHandout, str]:
    """The client side: this token's tenant's hbm pool, and the tenant. The caller owns the
    handout's fd, if any (the CPU implementation's: map it, then close it). Errors as for
    ``receive_arena``."""
    request: dict[str, Any] = {"token": token, "want": "pool"} if token is not None else {"want": "pool"}
    answer, fd = _exchange(path, request, timeout_s)
    try:
        handout = PoolHandout(str(answer["device"]), int(answer["size_bytes"]), bytes.fromhex(answer["pool_token"]),
                              -1 if fd is None else fd, str(answer["handle"]))
        if (fd is None) == (not handout.handle):
            raise KVStoreError(f"arena socket {path}: a pool comes with a descriptor or a handle, one of them")
    except (ValueError, KeyError) as exc:
        if fd is not None:
            os.close(fd)
        raise KVStoreError(f"arena socket {path}: bad answer: {exc}") from None
    except KVStoreError:
        if fd is not None:
            os.close(fd)
        raise
    return handout, str(answer["tenant"])


def _exchange(path: Path, request: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], int | None]:
    """One request and its answer, with the descriptor it carried (the caller owns it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            _connect(sock, path, time.monotonic() + timeout_s)
            check_served_by_us(sock, path)  # the request carries the token
            _send(sock, request)
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
                message = f"arena socket {path}: {answer.get('error', 'refused')}"
                raise named_error(str(answer.get("error_class")), message) or KVStoreError(message)
            if len(fds) > 1:
                raise KVStoreError(f"arena socket {path}: more than one file descriptor")
            return answer, fds.pop() if fds else None
        except (ValueError, KeyError, OSError) as exc:
            raise KVStoreError(f"arena socket {path}: bad answer: {exc}") from None
        finally:
            for stray in fds:
                os.close(stray)
