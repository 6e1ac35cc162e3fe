"""Plain TCP sockets for the page data plane: the options every data socket gets, length-
prefixed frames, and exact receives bounded by a deadline.

More: kvstore/cluster/README.md (### tcp_socket.py); DESIGN §12.3.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time

from kvstore.cluster.cluster_errors import TransportError
from kvstore.errors import InvalidRequest
from kvstore.pagecopy import _copyhash

_native = _copyhash if _copyhash is not None and hasattr(_copyhash, "recv_hashed") else None

CONGESTION = b"cubic"
CHUNK_BYTES = 256 << 10  # hashed right after it lands or right before it leaves: fits in L2
BUFFER_BYTES = 4 << 20  # SO_SNDBUF / SO_RCVBUF asked for (the kernel caps them at [rw]mem_max)
_SIZE = struct.Struct("<Q")
_TIMEVAL = struct.Struct("@ll")
LONGEST_WAIT_S = 1e9  # ~31 years: what an infinite deadline waits (timeval holds it; _sockhash.c alike)
logger = logging.getLogger(__name__)
_told = threading.Event()  # the refused congestion control is logged once per process


def tune(sock: socket.socket) -> None:
    """The data plane's per-socket options; each one the kernel refuses keeps its default."""
    for level, option, value in ((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
                                 (socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER_BYTES),
                                 (socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER_BYTES)):
        try:
            sock.setsockopt(level, option, value)
        except OSError:
            pass
    congestion = getattr(socket, "TCP_CONGESTION", None)
    if congestion is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, congestion, CONGESTION)
        except OSError as exc:  # not built into this kernel, or not allowed for this user
            if not _told.is_set():
                _told.set()
                kept = sock.getsockopt(socket.IPPROTO_TCP, congestion, 16).rstrip(b"\0").decode()
                logger.warning("TCP data sockets keep congestion control %s: %s refused (%s); a non-root server "
                               "needs %s in net.ipv4.tcp_allowed_congestion_control (bbr moved a third "
                               "of cubic's bytes on loopback)", kept, CONGESTION.decode(), exc.strerror, CONGESTION.decode())


class Deadline:
    """A point on the monotonic clock that bounds every blocking call on one socket."""

    def __init__(self, timeout_s: float) -> None:
        self.at = time.monotonic() + timeout_s

    def left(self) -> float:
        return self.at - time.monotonic()

    def arm(self, sock: socket.socket) -> None:
        """Sets the kernel's send and receive timeouts to what is left; TimeoutError if nothing is."""
        left = min(self.left(), LONGEST_WAIT_S)  # Deadline(math.inf): waits without end, in timeval's range
        if not left > 0:
            raise TimeoutError("the deadline passed")
        seconds = int(left)
        value = _TIMEVAL.pack(seconds, max(1, int((left - seconds) * 1e6)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def recv_exact(sock: socket.socket, view: memoryview, deadline: Deadline) -> None:
    """Fills ``view`` from ``sock``: TransportError when the peer closes first, TimeoutError
    when ``deadline`` passes (the kernel's timeout, armed by the caller, ends a receive; the
    loop re-arms it). The kernel's timeout bounds each receive call, not their sum: a
    caller re-arms it now and then (per page), and the fetcher's watchdog ends the rest."""
    got, n = 0, view.nbytes
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        except BlockingIOError:  # SO_RCVTIMEO expired with nothing received
            k = -1
        if k < 0:
            deadline.arm(sock)  # raises TimeoutError once the deadline itself passed (outside the except:
            continue            # no context chained to it, whose frames would hold ``view``)
        if k == 0:
            raise TransportError(f"the peer closed the connection {n - got} bytes short")
        got += k
        if got < n:
            deadline.arm(sock)


def send_exact(sock: socket.socket, data: bytes | memoryview, deadline: Deadline) -> None:
    """Sends all of ``data`` by ``deadline``: the kernel's timeout re-armed to what is left
    before each send call. ``sendall`` would re-use one armed timeout for every partial
    send, so a peer reading a trickle (each call progressing a little) stretched one 256 KiB
    chunk to several timeouts: pins held 4.1 s with a 1 s send timeout."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        deadline.arm(sock)  # TimeoutError once the deadline passed
        try:
            sent = sock.send(view)
        except BlockingIOError:  # SO_SNDTIMEO expired with nothing sent: arm() decides
            continue
        view = view[sent:]


def recv_hashed(sock: socket.socket, view: memoryview, digest: object, deadline: Deadline) -> None:
    """Fills ``view`` as ``recv_exact`` does (the same errors), feeding ``digest`` (a
    ``running_checksum``) each chunk as it lands. Natively one call per page, the GIL
    released throughout (``_sockhash.c``); else chunk by chunk here."""
    if _native is not None and isinstance(digest, _native.Checksum):
        got, status, err = _native.recv_hashed(sock.fileno(), view, digest, CHUNK_BYTES, deadline.at)
        _raise_for(status, err, f"the peer closed the connection {view.nbytes - got} bytes short")
        return
    deadline.arm(sock)
    for at in range(0, view.nbytes, CHUNK_BYTES):
        piece = view[at: at + CHUNK_BYTES]
        recv_exact(sock, piece, deadline)
        digest.update(piece)  # type: ignore[attr-defined]


def send_hashed(sock: socket.socket, view: memoryview, digest: object, expected: int, deadline: Deadline) -> bool:
    """Sends ``view`` chunk by chunk, each fed to ``digest`` (a fresh ``running_checksum``)
    just before it is sent, so the kernel copies it from cache; the last chunk only if the
    whole matched ``expected``. False (the rest unsent) when it did not. Natively one call,
    the GIL released, every send bounded by what is left of ``deadline``."""
    if _native is not None and isinstance(digest, _native.Checksum):
        _, status, err = _native.send_hashed(sock.fileno(), view, digest, CHUNK_BYTES, deadline.at, expected)
        if status == _MISMATCH:
            return False
        _raise_for(status, err, "the connection closed")
        return True
    if not view.nbytes:
        return digest.intdigest() == expected  # type: ignore[attr-defined]  # no chunk, still a page to check
    for at in range(0, view.nbytes, CHUNK_BYTES):
        piece = view[at: at + CHUNK_BYTES]
        digest.update(piece)  # type: ignore[attr-defined]
        if at + CHUNK_BYTES >= view.nbytes and digest.intdigest() != expected:  # type: ignore[attr-defined]
            return False
        send_exact(sock, piece, deadline)
    return True


_CLOSED, _LATE, _FAILED, _MISMATCH = 1, 2, 3, 4  # the native calls' statuses (0: done)


def _raise_for(status: int, err: int, closed: str) -> None:
    if status == _CLOSED:
        raise TransportError(closed)
    if status == _LATE:
        raise TimeoutError("the deadline passed")
    if status == _FAILED:
        raise OSError(err, os.strerror(err))


def send_frame(sock: socket.socket, body: bytes, deadline: Deadline) -> None:
    send_exact(sock, _SIZE.pack(len(body)) + body, deadline)


def recv_frame(sock: socket.socket, max_bytes: int, deadline: Deadline) -> bytearray:
    """One length-prefixed frame of at most ``max_bytes`` (checked before anything is allocated)."""
    deadline.arm(sock)
    head = bytearray(_SIZE.size)
    recv_exact(sock, memoryview(head), deadline)
    (size,) = _SIZE.unpack(head)
    if not 0 < size <= max_bytes:
        raise InvalidRequest(f"frame of {size} bytes is out of bounds")
    body = bytearray(size)
    recv_exact(sock, memoryview(body), deadline)
    return body


def wait_frame(sock: socket.socket, max_bytes: int) -> bytearray | None:
    """The next frame on an idle connection, waiting as long as it takes; None when the peer
    closed it cleanly between frames (a page server's connection waiting for a request)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(0, 0))  # 0: no timeout
    try:
        first = sock.recv(1, socket.MSG_PEEK)
    except OSError as exc:
        raise TransportError(f"connection lost: {exc!r}") from None
    if not first:
        return None
    return recv_frame(sock, max_bytes, Deadline(30.0))  # a frame that started arrives whole within 30 s


def shut(sock: socket.socket) -> None:
    """Ends a connection from any thread: a receive or send blocked in another thread returns
    at once (shutdown wakes it, close alone does not)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
