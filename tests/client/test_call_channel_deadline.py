"""The client side of the same-host call channel (kvstore/callsocket/client_sync.py) against a peer that
speaks its frames on a real Unix socket, scripted to answer late or not at all."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from pathlib import Path

import pytest

from kvstore._proto import data_pb2
from kvstore.callsocket import frames
from kvstore.callsocket.client_sync import CallChannel

CALL_TOKEN = secrets.token_bytes(frames.CALL_TOKEN_BYTES)


def _read_request(conn: socket.socket) -> tuple[int, bytes] | None:
    header = conn.recv(frames.REQUEST_HEADER.size, socket.MSG_WAITALL)
    if len(header) < frames.REQUEST_HEADER.size:
        return None
    body_bytes, method_id, _ = frames.REQUEST_HEADER.unpack(header)
    return method_id, conn.recv(body_bytes, socket.MSG_WAITALL) if body_bytes else b""


def _late_acquire_peer(listener: socket.socket, asked: list[int], done: threading.Event) -> None:
    """Answers each connection's HELLO; on the first connection it answers the first call and,
    at once, an Acquire not yet asked (so that it is there when the caller's deadline passes).
    Every later request is read and left unanswered (a stalled server)."""
    first = True
    while not done.is_set():
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_serve, args=(conn, first, asked, done), daemon=True).start()
        first = False


def _serve(conn: socket.socket, first: bool, asked: list[int], done: threading.Event) -> None:
    with conn:
        if _read_request(conn) is None:
            return
        conn.sendall(frames.answer_frame(0, CALL_TOKEN + b"t"))
        if first and _read_request(conn) is not None:
            lease = data_pb2.AcquireResponse(lease_id=b"L" * 16).SerializeToString()
            conn.sendall(frames.answer_frame(0, data_pb2.WhoAmIResponse(tenant="t").SerializeToString())
                         + frames.answer_frame(0, lease))
        while (request := _read_request(conn)) is not None:
            asked.append(request[0])
        done.wait(10)


def test_a_late_answer_is_given_back_without_blocking_past_the_deadline(tmp_path: Path) -> None:
    """A call past its deadline raises TimeoutError at that deadline: a late lease it finds is
    given back without waiting for the give-back's answer (the connector calls from the
    engine's thread with a budget of a few ms). Before: the give-back was a blocking call with
    the channel's whole timeout, so a stalled server held the caller that long again."""
    path = tmp_path / "call.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    asked: list[int] = []
    done = threading.Event()
    peer = threading.Thread(target=_late_acquire_peer, args=(listener, asked, done), daemon=True)
    peer.start()
    try:
        channel = CallChannel(str(path), None, CALL_TOKEN, timeout_s=3.0)
        channel.call("Data.WhoAmI", data_pb2.WhoAmIRequest(), data_pb2.WhoAmIResponse)  # a connection ready
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            channel.call("Data.Acquire", data_pb2.AcquireRequest(namespace_id=b"n" * 16, keys=[b"k" * 16]),
                         data_pb2.AcquireResponse, timeout_s=1e-6)
        took = time.monotonic() - started
        assert took < 1.0, f"a call with a deadline of 1 us returned after {took:.2f} s"
        deadline = time.monotonic() + 5
        while frames.METHOD_IDS["Data.Release"] not in asked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert frames.METHOD_IDS["Data.Release"] in asked, "the late lease was not given back"
        assert channel.num_late == 1
        channel.close()
    finally:
        done.set()
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        listener.close()
        peer.join(5)


def test_a_socket_that_never_answers_hello_is_not_used(tmp_path: Path) -> None:
    """A call socket that accepts and never answers (a stalled server, a stranger's socket) is
    'not usable': open gives None and the client uses gRPC. Before, its TimeoutError came out
    of open and failed the client's connect."""
    path = tmp_path / "call.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    try:
        assert CallChannel.open(str(path), "token", CALL_TOKEN, 0.2) is None
    finally:
        listener.close()
