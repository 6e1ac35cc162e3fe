"""One call-socket connection's frames on the server, read and written with the kernel's timeouts.

Why not ``socket.settimeout``: a Python socket with a timeout polls before every recv and send,
each a hand-over of the GIL. Here the socket stays blocking, ``SO_RCVTIMEO``/``SO_SNDTIMEO``
bound each syscall, and one ``recv_into`` takes a whole request into a buffer it usually fits:
a lookup is one recv and one send. Between frames the peer may stay silent for ``first_byte_s``;
a frame begun must be whole, and an answer taken, within the frame timeout.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

import grpc

from kvstore.callsocket import frames

BUFFER_BYTES = 64 << 10  # a 512-key Lookup is ~9 KiB, a 4096-key one ~80 KiB (read past the buffer)
_TIMEVAL = struct.Struct("@ll")


class Close(Exception):
    """Ends a connection, answering ``code``/``message`` (as ``error_class``) first when the peer can hear it."""

    def __init__(self, code: grpc.StatusCode | None, message: str, error_class: str = "") -> None:
        super().__init__(message)
        self.code, self.error_class = code, error_class


def _too_late() -> Close:
    return Close(grpc.StatusCode.DEADLINE_EXCEEDED, "the frame did not arrive whole in time")


class FrameConn:
    """Request frames in, answer frames out, on one accepted (blocking) connection."""

    def __init__(self, conn: socket.socket, frame_timeout_s: float) -> None:
        conn.settimeout(None)  # blocking: the kernel's timeouts below bound each syscall
        self.conn = conn
        self._frame_s = frame_timeout_s
        self._buf = bytearray(BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # the unread bytes are _buf[_start:_end]
        self._timeouts = {socket.SO_RCVTIMEO: -1.0, socket.SO_SNDTIMEO: -1.0}

    def _timeout(self, option: int, seconds: float) -> None:
        """Sets a kernel timeout, only when it changes (a zero timeval means none: at least 1 us)."""
        if self._timeouts[option] != seconds:
            usec = max(1, round(seconds * 1e6))
            self.conn.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(usec // 1_000_000, usec % 1_000_000))
            self._timeouts[option] = seconds

    def _recv(self, view: memoryview, wait_s: float) -> int:
        """One recv_into ``view`` within ``wait_s``; 0 when the peer closed. Raises TimeoutError."""
        self._timeout(socket.SO_RCVTIMEO, wait_s)
        try:
            return self.conn.recv_into(view)
        except BlockingIOError:  # EAGAIN: SO_RCVTIMEO ran out
            raise TimeoutError from None

    def _recv_by(self, view: memoryview, deadline: float) -> int:
        """``_recv`` of a frame under way: past ``deadline``, or closed by the peer, it ends the connection."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise _too_late()
        try:
            got = self._recv(view, left)
        except TimeoutError:
            raise _too_late() from None
        if got == 0:
            raise Close(None, "the peer closed the connection mid-frame")
        return got

    def _free(self) -> memoryview:
        """The buffer's free end, the unread bytes first moved to its start when it is full."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            left = self._end - self._start
            self._buf[:left] = self._buf[self._start : self._end]
            self._start, self._end = 0, left
        return self._view[self._end :]

    def _more(self, deadline: float) -> None:
        self._end += self._recv_by(self._free(), deadline)

    def read(self, first_byte_s: float, whole_within: float | None = None,
             header: Callable[[int, int], None] | None = None) -> tuple[int, int, bytes] | None:
        """The next request (method id, timeout_ms, body); None when the peer closed (or
        stayed silent past ``first_byte_s``) between frames. A frame begun must be whole
        within the frame timeout (``whole_within`` from now, when given). ``header(method id,
        body bytes)`` sees the header before anything else is checked or read, and may raise Close."""
        deadline = time.monotonic() + whole_within if whole_within is not None else None
        if self._start == self._end:
            try:
                got = self._recv(self._free(), first_byte_s)
            except TimeoutError:
                return None
            if got == 0:
                return None
            self._end += got
        if deadline is None:
            deadline = time.monotonic() + self._frame_s
        header_bytes = frames.REQUEST_HEADER.size
        while self._end - self._start < header_bytes:
            self._more(deadline)
        body_bytes, method_id, timeout_ms = frames.REQUEST_HEADER.unpack_from(self._buf, self._start)
        if header is not None:
            header(method_id, body_bytes)
        if body_bytes > frames.MAX_REQUEST_BYTES:
            raise Close(grpc.StatusCode.INVALID_ARGUMENT, f"a frame of {body_bytes} bytes; at most {frames.MAX_REQUEST_BYTES}")
        self._start += header_bytes
        if body_bytes <= len(self._buf) - self._start:  # fits where it lands: no copy but the last
            while self._end - self._start < body_bytes:
                self._more(deadline)
            body = bytes(self._view[self._start : self._start + body_bytes])
            self._start += body_bytes
            return method_id, timeout_ms, body
        return method_id, timeout_ms, self._large(body_bytes, deadline)

    def _large(self, body_bytes: int, deadline: float) -> bytes:
        """A body past the buffer's end: what was buffered, then the rest read in place."""
        body = bytearray(body_bytes)
        view = memoryview(body)
        got = min(body_bytes, self._end - self._start)
        view[:got] = self._view[self._start : self._start + got]
        self._start += got
        while got < body_bytes:
            got += self._recv_by(view[got:], deadline)
        return bytes(body)

    def send(self, data: bytes, within_s: float | None = None) -> None:
        """Writes ``data`` whole within ``within_s`` (the frame timeout); raises OSError
        (TimeoutError past it) when the peer does not take it."""
        within = self._frame_s if within_s is None else within_s
        deadline = time.monotonic() + within
        view, sent, left = memoryview(data), 0, within  # the first send's timeout is the same each time: no syscall
        while sent < len(data):
            if left <= 0:
                raise TimeoutError("the peer did not take its answer in time")
            self._timeout(socket.SO_SNDTIMEO, left)
            try:
                sent += self.conn.send(view[sent:])
            except BlockingIOError:
                raise TimeoutError("the peer did not take its answer in time") from None
            left = deadline - time.monotonic()
