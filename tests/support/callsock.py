"""Raw frames on a server's same-host call socket (kvstore/callsocket/frames.py), for the tests that
attack it: a caller that sends any frame as any token and reads the status it gets."""

from __future__ import annotations

import socket
from typing import Any

import grpc

from kvstore.callsocket import frames
from kvstore.server import Server

CODES = {int(code.value[0]): code for code in grpc.StatusCode}


def read_answer(sock: socket.socket) -> tuple[grpc.StatusCode, bytes] | None:
    """The next answer frame; None when the server closed the connection instead."""
    header = _exactly(sock, frames.ANSWER_HEADER.size)
    if header is None:
        return None
    body_bytes, status = frames.ANSWER_HEADER.unpack(header)
    body = _exactly(sock, body_bytes)
    assert body is not None, "the server closed the connection mid-answer"
    return CODES[status], body


def _exactly(sock: socket.socket, num_bytes: int) -> bytes | None:
    data = b""
    while len(data) < num_bytes:
        try:
            chunk = sock.recv(num_bytes - len(data))
        except ConnectionResetError:  # closed by the server with bytes of ours unread
            return None
        if not chunk:
            return None
        data += chunk
    return data


def connect(server: Server, token: str | None, timeout_s: float = 10.0) -> tuple[socket.socket, grpc.StatusCode]:
    """A connection that said HELLO with ``token``, and the status of its answer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(server.call_socket.path))  # blocking: a full backlog waits for the accept loop
    sock.settimeout(timeout_s)
    try:
        sock.sendall(frames.request_frame(frames.HELLO, 0, (token or "").encode()))
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused before the HELLO (no slot): the answer is there to read
    answer = read_answer(sock)
    assert answer is not None, "HELLO got no answer"
    return sock, answer[0]


class SocketCaller:
    """Calls over one authenticated connection, as Caller does over gRPC."""

    def __init__(self, server: Server, token: str | None) -> None:
        self.sock, status = connect(server, token)
        assert status == grpc.StatusCode.OK, status

    def raw(self, method: str, body: bytes, timeout_ms: int = 10_000) -> tuple[grpc.StatusCode, bytes] | None:
        self.sock.sendall(frames.request_frame(frames.METHOD_IDS[method], timeout_ms, body))
        return read_answer(self.sock)

    def code(self, method: str, request: Any) -> grpc.StatusCode:
        answer = self.raw(method, request.SerializeToString())
        assert answer is not None, f"{method}: the connection closed without an answer"
        return answer[0]

    def __call__(self, method: str, request: Any, response_type: Any) -> Any:
        answer = self.raw(method, request.SerializeToString())
        assert answer is not None, f"{method}: the connection closed without an answer"
        assert answer[0] == grpc.StatusCode.OK, (method, answer)
        return response_type.FromString(answer[1])

    def close(self) -> None:
        self.sock.close()
