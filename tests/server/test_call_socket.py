"""The same-host call socket (DESIGN §11 "Same-host paths"; kvstore/callsocket/frames.py) on a real server: the same
answers as gRPC, every bad frame answered with a clear status or the connection closed (the
server serves on), silent peers do not hold the slots, and an Acquire given up on by its
caller leaves no lease."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from support.callsock import SocketCaller, connect, read_answer
from support.kv import random_kv

from kvstore._proto import data_pb2, directory_pb2
from kvstore.callsocket import frames
from kvstore.callsocket.client_sync import CallChannel
from kvstore.client import KVStoreClient
from kvstore.server import Server
from kvstore.types import Namespace

OK = grpc.StatusCode.OK


@pytest.fixture
async def stored(server: Server, ns: Namespace) -> AsyncIterator[tuple[Server, KVStoreClient, list[bytes]]]:
    client = KVStoreClient(server.address, ns)
    await client.connect()
    tokens = list(range(4 * ns.layout.page_tokens))
    await client.put(tokens, random_kv(ns.layout, len(tokens)))
    yield server, client, client.keys(tokens)
    await client.close()


def _no_leases_soon(server: Server, timeout_s: float = 10.0) -> frozenset[bytes]:
    """The server's lease ids once none is left, or what is left at ``timeout_s``: a lease the
    server undoes after a failed answer goes on the connection's thread, after the caller left."""
    deadline = time.monotonic() + timeout_s
    while (left := server.core.view().lease_ids) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


async def test_the_call_socket_answers_as_grpc_does(stored: tuple[Server, KVStoreClient, list[bytes]]) -> None:
    server, client, keys = stored
    calls = client.calls.blocking
    assert calls is not None, "a client on the server's host uses its call socket"
    runtime = client.runtime
    ns_id = client.namespace.namespace_id
    lookup = directory_pb2.LookupRequest(namespace_id=ns_id, keys=keys + [b"\1" * 16])
    assert calls.call("Directory.Lookup", lookup, directory_pb2.LookupResponse) == \
        await client._io(runtime.rpc(runtime.directory.Lookup, lookup))
    for method, request, response in [("Data.GetInfo", data_pb2.GetInfoRequest(), data_pb2.GetInfoResponse),
                                      ("Data.WhoAmI", data_pb2.WhoAmIRequest(), data_pb2.WhoAmIResponse)]:
        stub = getattr(runtime.data, method.split(".")[1])
        assert calls.call(method, request, response) == await client._io(runtime.rpc(stub, request))
    acquire = data_pb2.AcquireRequest(namespace_id=ns_id, keys=keys)
    here = calls.call("Data.Acquire", acquire, data_pb2.AcquireResponse)
    there = await client._io(runtime.rpc(runtime.data.Acquire, acquire))
    assert list(here.pages) == list(there.pages) and here.page_bytes == there.page_bytes and len(here.pages) == 4
    for lease in (here.lease_id, there.lease_id):
        calls.call("Data.Release", data_pb2.ReleaseRequest(lease_id=lease), data_pb2.ReleaseResponse)
    assert not server.core.view().lease_ids
    bad = directory_pb2.LookupRequest(namespace_id=b"short", keys=keys)
    with pytest.raises(Exception) as here_err:
        calls.call("Directory.Lookup", bad, directory_pb2.LookupResponse)
    with pytest.raises(Exception) as there_err:
        await client._io(runtime.rpc(runtime.directory.Lookup, bad))
    assert (type(here_err.value), str(here_err.value)) == (type(there_err.value), str(there_err.value))


async def test_an_acquire_that_times_out_leaves_no_lease(stored: tuple[Server, KVStoreClient, list[bytes]]) -> None:
    """An Acquire whose answer comes after the caller's deadline must not leave a lease nobody
    can release (pinned for its TTL): the caller shuts its reading side, then gives back an
    answer that had arrived; an answer the server can no longer write, it undoes itself."""
    server, client, keys = stored
    calls = client.calls.blocking
    assert calls is not None
    request = data_pb2.AcquireRequest(namespace_id=client.namespace.namespace_id, keys=keys, ttl_ms=600_000)
    timed_out = 0
    for i in range(200):
        calls.call("Data.WhoAmI", data_pb2.WhoAmIRequest(), data_pb2.WhoAmIResponse)  # a connection ready: the deadline is the Acquire's
        try:
            acquired = calls.call("Data.Acquire", request, data_pb2.AcquireResponse, [1e-6, 1e-4, 3e-4, 1e-3][i % 4])
        except TimeoutError:
            timed_out += 1
            continue
        calls.call("Data.Release", data_pb2.ReleaseRequest(lease_id=acquired.lease_id), data_pb2.ReleaseResponse)
    assert timed_out >= 50
    assert _no_leases_soon(server) == frozenset(), f"{timed_out} timed out, {calls.num_late} answers given back late"
    assert calls.call("Directory.Lookup", directory_pb2.LookupRequest(namespace_id=client.namespace.namespace_id, keys=keys),
                      directory_pb2.LookupResponse).num_pages == 4


def _closed_or(sock: socket.socket, code: grpc.StatusCode) -> None:
    """The server answered ``code`` and closed the connection."""
    answer = read_answer(sock)
    assert answer is not None and answer[0] == code, answer
    assert read_answer(sock) is None


def _still_serves(server: Server) -> None:
    caller = SocketCaller(server, None)
    assert caller("Data.WhoAmI", data_pb2.WhoAmIRequest(), data_pb2.WhoAmIResponse).tenant
    caller.close()


def _raw(server: Server) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(server.call_socket.path))  # blocking: a full backlog waits for the accept loop
    sock.settimeout(10)
    return sock


def test_bad_frames_get_a_clear_status_and_the_server_serves_on(server: Server) -> None:
    invalid, unimplemented = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED
    sock = _raw(server)
    sock.sendall(b"\xff" * 10)  # a first frame of 4 GiB, not a HELLO: authentication comes first (DESIGN §11)
    _closed_or(sock, grpc.StatusCode.UNAUTHENTICATED)
    sock = _raw(server)
    sock.sendall(frames.request_frame(frames.METHOD_IDS["Data.WhoAmI"], 0, b""))  # no HELLO first
    _closed_or(sock, grpc.StatusCode.UNAUTHENTICATED)
    caller = SocketCaller(server, None)
    assert caller.raw("Data.WhoAmI", b"") is not None
    caller.sock.sendall(frames.request_frame(999, 0, b"x"))
    assert read_answer(caller.sock)[0] == unimplemented  # type: ignore[index]
    caller.sock.sendall(frames.request_frame(frames.HELLO, 0, b""))
    assert read_answer(caller.sock)[0] == unimplemented  # type: ignore[index]
    assert caller.raw("Directory.Lookup", b"\xff\xff\xff")[0] == invalid  # type: ignore[index]  # not a protobuf
    assert caller.raw("Directory.Lookup", b"\x0a" + b"\x7f" + b"x" * 10)[0] == invalid  # type: ignore[index]  # cut short
    assert caller("Data.WhoAmI", data_pb2.WhoAmIRequest(), data_pb2.WhoAmIResponse).tenant  # the connection goes on
    caller.sock.sendall(frames.REQUEST_HEADER.pack(frames.MAX_REQUEST_BYTES + 1, 1, 0))
    _closed_or(caller.sock, invalid)
    caller = SocketCaller(server, None)
    caller.sock.sendall(frames.REQUEST_HEADER.pack(100, 1, 0) + b"x" * 10)  # and never the rest
    _closed_or(caller.sock, grpc.StatusCode.DEADLINE_EXCEEDED)
    caller = SocketCaller(server, None)
    caller.sock.sendall(frames.REQUEST_HEADER.pack(100, 1, 0) + b"x" * 10)
    caller.sock.close()  # cut short by the peer
    _still_serves(server)


def test_random_frames_never_crash_or_hang_the_server(server: Server) -> None:
    rng = random.Random(15)
    valid = frames.request_frame(frames.METHOD_IDS["Directory.Lookup"], 5000,
                                    directory_pb2.LookupRequest(namespace_id=b"n" * 16, keys=[b"k" * 16] * 3).SerializeToString())
    for _ in range(300):
        frame = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            frame[rng.randrange(len(frame))] = rng.randrange(256)
        frame = frame[: rng.randint(1, len(frame))] if rng.random() < 0.2 else frame
        caller = SocketCaller(server, None)
        caller.sock.settimeout(5)
        caller.sock.sendall(bytes(frame))
        caller.sock.shutdown(socket.SHUT_WR)  # no more: a frame cut short is seen as such at once
        while True:
            answer = read_answer(caller.sock)  # an answer, or a closed connection: never a hang (the socket times out)
            if answer is None:
                break
            assert answer[0] not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), answer
        caller.close()
    _still_serves(server)
    assert not server.core.view().lease_ids and not server.core.view().num_allocations


def test_silent_peers_do_not_hold_the_slots(server: Server) -> None:
    """Connections that never say HELLO take at most the connection limit (of a process), and
    only until the HELLO deadline; a caller that did say HELLO is served meanwhile."""
    silent = [_raw(server) for _ in range(server.call_socket._max_per_pid - 1)]
    _still_serves(server)  # the last slot
    for sock in silent:
        assert sock.recv(1) == b"", "a silent peer is closed at the HELLO deadline"
        sock.close()
    _still_serves(server)


def test_connections_beyond_the_limit_are_refused_not_queued(server: Server) -> None:
    held = [SocketCaller(server, None) for _ in range(server.call_socket._max_per_pid)]
    sock, status = connect(server, None)
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED
    sock.close()
    held.pop().close()
    _held_slot_freed(server)
    for caller in held:
        caller.close()


def _held_slot_freed(server: Server) -> None:
    """The slot of a closed connection is free once the server saw the close (its thread
    ends): tried until then, bounded."""
    deadline = time.monotonic() + 10
    while True:
        sock, status = connect(server, None)
        sock.close()
        if status == OK or time.monotonic() > deadline:
            assert status == OK
            return
        time.sleep(0.01)


def test_a_channel_to_another_servers_socket_is_refused(server_factory: object, tmp_path: Path, ns: Namespace) -> None:
    """A socket at the announced path that answers another token is not this server's."""
    server = server_factory()  # type: ignore[operator]
    info = SocketCaller(server, None)("Data.GetInfo", data_pb2.GetInfoRequest(), data_pb2.GetInfoResponse)
    assert CallChannel.open(info.call_socket, None, b"\0" * frames.CALL_TOKEN_BYTES, 5.0) is None
    assert CallChannel.open(str(tmp_path / "nothing.sock"), None, info.call_token, 5.0) is None
    assert CallChannel.open(info.call_socket, None, info.call_token, 5.0) is not None


def test_a_caller_that_never_reads_its_answers_is_dropped(server: Server) -> None:
    """Requests sent without reading the answers fill both socket buffers; the server's write
    then waits at most its frame deadline and drops the connection (its thread and slot
    freed), and serves the others meanwhile."""
    caller = SocketCaller(server, None)
    frame = frames.request_frame(frames.METHOD_IDS["Data.WhoAmI"], 0, b"") * 1000
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for _ in range(1000):  # 10 MB of requests: far more than the buffers hold
            caller.sock.sendall(frame)
    _still_serves(server)
    caller.close()



_OTHER_PROCESS_HELLO = """
import socket, sys
sys.path.insert(0, sys.argv[2])
from support.callsock import CODES, read_answer
from kvstore.callsocket import frames
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(10)
sock.connect(sys.argv[1])
try:
    sock.sendall(frames.request_frame(frames.HELLO, 0, b""))
except OSError:
    pass
answer = read_answer(sock)
print(answer[0].name if answer else "CLOSED")
"""


def test_one_process_cannot_take_every_connection(server: Server) -> None:
    """A process of the server's uid (any tenant's) that opens connections as fast as it can
    must not keep another process from the call socket: it holds at most its own share of
    the connections, and a second process is still served."""
    held: list[socket.socket] = []
    while True:
        sock, status = connect(server, None)
        if status != OK:
            sock.close()
            break
        held.append(sock)
    try:
        assert len(held) < 256, "one process took every connection of the call socket"
        other = subprocess.run([sys.executable, "-c", _OTHER_PROCESS_HELLO, str(server.call_socket.path),
                                str(Path(__file__).parents[1])], check=False, capture_output=True, text=True, timeout=60)
        assert other.stdout.strip() == "OK", other.stdout + other.stderr
    finally:
        for sock in held:
            sock.close()


def test_a_peer_thread_that_cannot_start_costs_that_peer_only(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process out of threads ("can't start new thread") made the accept loop die on
    Thread.start(): the call socket stayed dead until a restart. The peer is closed, its
    slot given back, and the next caller is served. (The one fake here: thread exhaustion
    cannot be made on purpose without starving the test itself.)"""
    import threading

    start = threading.Thread.start
    failed: list[str] = []

    def start_or_fail(thread: threading.Thread) -> None:
        if thread.name == "call-peer" and not failed:
            failed.append(thread.name)
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_or_fail)
    first = _raw(server)
    first.settimeout(5)
    assert first.recv(1) == b""  # closed unanswered
    first.close()
    assert failed
    _still_serves(server)
