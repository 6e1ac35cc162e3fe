"""How the call socket reads its frames (kvstore/callsocket/server_conn.py), on a real
server: a request larger than the read buffer, requests sent back to back in one write, a
frame that trickles in, and the kernel timeouts that bound a silent or slow peer."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest
from support.callsock import SocketCaller, read_answer
from support.kv import random_kv

from kvstore._proto import data_pb2, directory_pb2
from kvstore.callsocket import frames
from kvstore.callsocket.server_conn import BUFFER_BYTES
from kvstore.client import KVStoreClient
from kvstore.server import Server
from kvstore.types import Namespace


async def _stored(server: Server, ns: Namespace, pages: int) -> list[bytes]:
    async with KVStoreClient(server.address, ns) as client:
        tokens = list(range(pages * ns.layout.page_tokens))
        await client.put(tokens, random_kv(ns.layout, len(tokens)))
        return client.keys(tokens)


def _lookup_frame(ns: Namespace, keys: list[bytes]) -> bytes:
    body = directory_pb2.LookupRequest(namespace_id=ns.namespace_id, keys=keys).SerializeToString()
    return frames.request_frame(frames.METHOD_IDS["Directory.Lookup"], 10_000, body)


def _num_pages(answer: tuple[grpc.StatusCode, bytes] | None) -> int:
    assert answer is not None and answer[0] == grpc.StatusCode.OK, answer
    return directory_pb2.LookupResponse.FromString(answer[1]).num_pages


async def test_a_request_larger_than_the_buffer_is_read_whole(server: Server, ns: Namespace) -> None:
    keys = await _stored(server, ns, 4)
    missing = [bytes([i % 256, i // 256]) * 8 for i in range(6000)]  # 6,004 keys: ~100 KiB
    frame = _lookup_frame(ns, keys + missing)
    assert len(frame) > BUFFER_BYTES
    caller = SocketCaller(server, None)
    caller.sock.sendall(frame + _lookup_frame(ns, keys))  # and one right behind it, in the same write
    assert _num_pages(read_answer(caller.sock)) == 4
    assert _num_pages(read_answer(caller.sock)) == 4
    caller.close()


async def test_requests_sent_back_to_back_are_answered_in_order(server: Server, ns: Namespace) -> None:
    keys = await _stored(server, ns, 4)
    caller = SocketCaller(server, None)
    caller.sock.sendall(b"".join(_lookup_frame(ns, keys[:n]) for n in range(1, 5)) * 50)  # 200 frames, one write
    assert [_num_pages(read_answer(caller.sock)) for _ in range(200)] == [1, 2, 3, 4] * 50
    caller.close()


async def test_a_frame_that_trickles_in_within_its_deadline_is_served(server: Server, ns: Namespace) -> None:
    keys = await _stored(server, ns, 4)
    frame = _lookup_frame(ns, keys)
    caller = SocketCaller(server, None)
    for i in range(0, len(frame), 7):  # the header itself in pieces
        caller.sock.sendall(frame[i : i + 7])
        await asyncio.sleep(0.001)
    assert _num_pages(read_answer(caller.sock)) == 4
    caller.close()


def test_a_frame_begun_must_end_within_the_frame_timeout(server: Server) -> None:
    """Bytes that keep coming, too slowly, do not stretch the frame's deadline."""
    caller = SocketCaller(server, None)
    frame_s = server.call_socket.frame_timeout_s
    started = time.monotonic()
    caller.sock.sendall(frames.REQUEST_HEADER.pack(1000, frames.METHOD_IDS["Data.WhoAmI"], 0))
    with pytest.raises(OSError):
        while time.monotonic() - started < frame_s + 5:
            caller.sock.sendall(b"x")  # a byte every 0.1 s: the 1,000-byte body would take 100 s
            time.sleep(0.1)
    answer = read_answer(caller.sock)
    assert answer is None or answer[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < frame_s + 3, "the frame's deadline was stretched by its trickle"
    caller.close()


def test_an_idle_connection_is_served_after_its_silence(server: Server) -> None:
    """A wait between frames shorter than the idle timeout leaves the connection open."""
    caller = SocketCaller(server, None)
    time.sleep(server.call_socket.frame_timeout_s + 0.5)  # longer than a frame may take, shorter than idle
    assert caller("Data.WhoAmI", data_pb2.WhoAmIRequest(), data_pb2.WhoAmIResponse).tenant
    caller.sock.shutdown(socket.SHUT_WR)
    assert read_answer(caller.sock) is None  # the server closes its end at the peer's close
    caller.close()
