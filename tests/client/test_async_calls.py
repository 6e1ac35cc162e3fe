"""The async client's unary calls over the same-host call socket (DESIGN §11; kvstore/callsocket/client_aio.py):
with shared memory on the server's host, put/lookup/get make no gRPC unary call; a stalled
server ends a call at its deadline and leaves no lease (a restarted server: test_restart_calls.py)."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from support.kv import random_kv
from support.servers import ServerProcess
from test_call_channel_deadline import CALL_TOKEN, _read_request

from kvstore import KVLayout, Namespace
from kvstore._proto import data_pb2, directory_pb2, directory_pb2_grpc
from kvstore.callsocket import frames
from kvstore.callsocket.client_aio import AsyncCallChannel
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError


def recorded(calls: list[str], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a real method), noting the name of each call's first argument in ``calls``."""

    async def spy(method: Any, *args: Any, **kw: Any) -> Any:
        calls.append(method if isinstance(method, str) else str(method))
        return await fn(method, *args, **kw)

    return spy


def spy_on(client: KVStoreClient, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    """(the calls made over the call socket, the unary calls made over gRPC) from now on. Every
    AsyncCallChannel's calls: the runtime's, and the caller loop's that lookups take (client/calls.py)."""
    assert client.runtime.local is not None
    socket_calls: list[str] = []
    grpc_calls: list[str] = []
    real_call = AsyncCallChannel.call

    async def call(channel: AsyncCallChannel, method: str, *args: Any) -> Any:
        socket_calls.append(method)
        return await real_call(channel, method, *args)

    monkeypatch.setattr(AsyncCallChannel, "call", call)
    client.runtime.rpc = recorded(grpc_calls, client.runtime.rpc)  # type: ignore[method-assign]
    return socket_calls, grpc_calls


def num_leases(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return int(directory_pb2_grpc.DirectoryStub(channel).Stats(directory_pb2.StatsRequest(), timeout=10).num_leases)


async def test_put_lookup_get_make_no_grpc_unary_call(server, ns: Namespace, layout: KVLayout,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = torch.arange(5 * layout.page_tokens)
    kv = random_kv(layout, len(tokens))
    async with KVStoreClient(server.address, ns) as client:
        assert client.shared_memory
        socket_calls, grpc_calls = spy_on(client, monkeypatch)
        assert await client.put(tokens, kv) == len(tokens)
        hit = await client.lookup(tokens)
        assert hit.num_tokens == len(tokens)
        into = torch.zeros_like(kv)
        assert await client.get(hit, into) == len(tokens)
        assert torch.equal(into, kv)
    assert grpc_calls == []
    assert {"Data.Allocate", "Data.Commit", "Directory.Lookup", "Data.Acquire", "Data.Release"} <= set(socket_calls)
    assert num_leases(server.address) == 0


async def test_without_the_call_socket_the_calls_go_over_grpc(server, ns: Namespace, layout: KVLayout) -> None:
    tokens = torch.arange(2 * layout.page_tokens)
    kv = random_kv(layout, len(tokens))
    async with KVStoreClient(server.address, ns, use_call_socket=False) as client:
        assert client.runtime.local is None
        assert await client.put(tokens, kv) == len(tokens)
        into = torch.zeros_like(kv)
        assert await client.get(await client.lookup(tokens), into) == len(tokens)
        assert torch.equal(into, kv)


async def test_a_stalled_server_ends_the_call_at_its_deadline_and_leaves_no_lease(server_process: ServerProcess,
                                                                                  ns: Namespace, layout: KVLayout,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    server_process.start()
    tokens = torch.arange(2 * layout.page_tokens)
    kv = random_kv(layout, len(tokens))
    async with KVStoreClient(server_process.address, ns, timeout_s=1.0) as client:
        assert client.runtime.local is not None
        assert await client.put(tokens, kv) == len(tokens)
        hit = await client.lookup(tokens)
        socket_calls, grpc_calls = spy_on(client, monkeypatch)
        server_process.freeze()
        started = time.monotonic()
        try:
            try:
                await client.get(hit, torch.zeros_like(kv))
                raise AssertionError("a stopped server answered")
            except KVStoreError as exc:
                assert "DEADLINE_EXCEEDED" in str(exc)
            assert time.monotonic() - started < 1.0 + 0.5
        finally:
            assert server_process.proc is not None
            server_process.proc.send_signal(signal.SIGCONT)
        assert socket_calls == ["Data.Acquire"] and grpc_calls == []
        deadline = time.monotonic() + 10
        while num_leases(server_process.address) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the resumed server fails to answer the abandoned Acquire and undoes it
        assert num_leases(server_process.address) == 0
        into = torch.zeros_like(kv)
        assert await client.get(hit, into) == len(tokens)  # the socket serves again
        assert torch.equal(into, kv)


def _scripted_peer(listener: socket.socket, asked: list[int], received: threading.Event, go: threading.Event,
                   answered: threading.Event) -> None:
    """Answers each connection's HELLO; answers an Acquire (a lease) only once ``go`` is set,
    and every other call with an empty OK. Notes the method ids it was asked."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_serve_scripted, args=(conn, asked, received, go, answered), daemon=True).start()


def _serve_scripted(conn: socket.socket, asked: list[int], received: threading.Event, go: threading.Event,
                    answered: threading.Event) -> None:
    with conn:
        if _read_request(conn) is None:
            return
        conn.sendall(frames.answer_frame(0, CALL_TOKEN + b"t"))
        while (request := _read_request(conn)) is not None:
            asked.append(request[0])
            if request[0] == frames.METHOD_IDS["Data.Acquire"]:
                received.set()
                go.wait(10)
                conn.sendall(frames.answer_frame(0, data_pb2.AcquireResponse(lease_id=b"L" * 16).SerializeToString()))
                answered.set()
            else:
                conn.sendall(frames.answer_frame(0, b""))


async def test_a_lease_answered_to_a_cancelled_call_is_given_back(tmp_path: Path) -> None:
    """The answer of an Acquire arrived while its caller was being cancelled (it never read it):
    the channel reads it after shutting the connection and releases the lease."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "call.sock"))
    listener.listen(8)
    asked: list[int] = []
    received, go, answered = threading.Event(), threading.Event(), threading.Event()
    threading.Thread(target=_scripted_peer, args=(listener, asked, received, go, answered), daemon=True).start()
    try:
        channel = await AsyncCallChannel.open(str(tmp_path / "call.sock"), None, CALL_TOKEN)
        assert channel is not None
        call = asyncio.ensure_future(channel.call("Data.Acquire", data_pb2.AcquireRequest(keys=[b"k" * 16]), 10.0))
        assert await asyncio.get_running_loop().run_in_executor(None, received.wait, 10)
        go.set()
        assert answered.wait(10)  # blocks this loop: the call cannot read the answer before it is cancelled
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await channel.close()  # waits for the give-back
        assert channel.num_late == 1
        assert asked == [frames.METHOD_IDS["Data.Acquire"], frames.METHOD_IDS["Data.Release"]]
    finally:
        listener.close()
