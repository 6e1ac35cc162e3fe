"""Lookups on the caller's own event loop (client/calls.py, DESIGN §8): over a call-socket
channel of that loop, without the hop to the I/O runtime; a stalled server ends them at their
deadline, a cancelled one leaves no connection behind, a socket that does not take them hands
them to the runtime, and close leaves no connection of any loop open on the server."""

from __future__ import annotations

import asyncio
import gc
import signal
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from support.kv import random_kv
from support.servers import ServerProcess

from kvstore import KVLayout, Namespace
from kvstore._proto import data_pb2, directory_pb2
from kvstore.callsocket.client_aio import AsyncCallChannel, NotSent
from kvstore.client import KVStoreClient
from kvstore.client.runtime import Runtime
from kvstore.errors import KVStoreError
from kvstore.server.tenancy.gate import Gate


def spy(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    """(the calls made over any AsyncCallChannel, the coroutines handed to any Runtime) from now on."""
    socket_calls: list[str] = []
    hops: list[str] = []
    real_call, real_hop = AsyncCallChannel.call, Runtime.call

    async def call(channel: AsyncCallChannel, method: str, *args: Any) -> Any:
        socket_calls.append(method)
        return await real_call(channel, method, *args)

    async def hop(runtime: Runtime, coro: Any) -> Any:
        hops.append(coro.__qualname__)
        return await real_hop(runtime, coro)

    monkeypatch.setattr(AsyncCallChannel, "call", call)
    monkeypatch.setattr(Runtime, "call", hop)
    return socket_calls, hops


def connections_to(path: str) -> int:
    """Connected sockets of this host bound to ``path``: the server's ends of the call socket's
    connections (an accepted socket carries its listener's path in /proc/net/unix)."""
    with open("/proc/net/unix") as f:
        return sum(1 for line in f.readlines()[1:] if line.split()[-1] == path and line.split()[5] == "03")


def wait_for(predicate: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


async def stored(client: KVStoreClient, layout: KVLayout, pages: int) -> list[bytes]:
    tokens = torch.arange(pages * layout.page_tokens)
    assert await client.put(tokens, random_kv(layout, len(tokens))) == len(tokens)
    return client.keys(tokens)


async def test_a_lookup_runs_on_the_callers_loop_without_a_hop(server, ns: Namespace, layout: KVLayout,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    async with KVStoreClient(server.address, ns) as client:
        keys = await stored(client, layout, 6)
        socket_calls, hops = spy(monkeypatch)
        hit = await client.lookup_keys(keys)
        assert hit.num_pages == 6 and hit.keys == keys
        assert [(r.tier, r.num_pages) for r in hit.runs] == [("host", 6)]
        assert (await client.lookup_keys(keys[:3] + [b"\0" * 16])).num_pages == 3
        # another thread's loop: a channel of its own, no hop either
        other = await asyncio.to_thread(asyncio.run, client.lookup_keys(keys))
        assert other.num_pages == 6
        assert socket_calls == ["Directory.Lookup"] * 3 and hops == []
        # on the runtime loop itself (a coroutine submitted to it, as engine hooks do): the runtime's channel
        assert (await client.runtime.call(client.lookup_keys(keys))).num_pages == 6
        assert socket_calls == ["Directory.Lookup"] * 4


async def test_a_stalled_server_ends_the_lookup_at_its_deadline(server_process: ServerProcess, ns: Namespace,
                                                                 layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    server_process.start()
    async with KVStoreClient(server_process.address, ns, timeout_s=1.0) as client:
        keys = await stored(client, layout, 2)
        assert (await client.lookup_keys(keys)).num_pages == 2  # this loop's channel is connected
        socket_calls, hops = spy(monkeypatch)
        server_process.freeze()
        started = time.monotonic()
        try:
            with pytest.raises(KVStoreError, match="DEADLINE_EXCEEDED"):
                await client.lookup_keys(keys)
            assert time.monotonic() - started < 1.0 + 0.5
        finally:
            assert server_process.proc is not None
            server_process.proc.send_signal(signal.SIGCONT)
        assert socket_calls == ["Directory.Lookup"] and hops == []
        assert (await client.lookup_keys(keys)).num_pages == 2  # a new connection of this loop


async def test_a_cancelled_lookup_leaves_no_connection(server_process: ServerProcess, ns: Namespace, layout: KVLayout) -> None:
    server_process.start()
    async with KVStoreClient(server_process.address, ns, timeout_s=10.0) as client:
        keys = await stored(client, layout, 2)
        assert (await client.lookup_keys(keys)).num_pages == 2
        path = client.calls.blocking.path if client.calls.blocking is not None else ""
        before = connections_to(path)
        server_process.freeze()
        try:
            lookup = asyncio.ensure_future(client.lookup_keys(keys))
            await asyncio.sleep(0.2)  # sent, waiting for the answer
            started = time.monotonic()
            lookup.cancel()
            with pytest.raises(asyncio.CancelledError):
                await lookup
            assert time.monotonic() - started < 0.5, "a cancel waits for no answer"
        finally:
            assert server_process.proc is not None
            server_process.proc.send_signal(signal.SIGCONT)
        assert wait_for(lambda: connections_to(path) == before - 1), "the cancelled call's connection was kept"
        assert (await client.lookup_keys(keys)).num_pages == 2


async def test_a_socket_that_does_not_take_the_lookup_hands_it_to_the_runtime(
        server, ns: Namespace, layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    async with KVStoreClient(server.address, ns) as client:
        keys = await stored(client, layout, 3)
        Path(server.call_socket.path).unlink()  # connected channels go on; a new connection fails (NotSent)
        socket_calls, hops = spy(monkeypatch)
        assert (await client.lookup_keys(keys)).num_pages == 3
        assert len(hops) == 1, "the lookup went through the runtime"
        assert socket_calls == ["Directory.Lookup"] * 2  # this loop's channel, not taken; the runtime's


async def test_lookups_past_the_loops_connections_wait_for_none(server, ns: Namespace, layout: KVLayout,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The server holds each lookup until all six arrived, so the loop's two connections are busy
    when the other four try them. Without the hold a lookup could run its whole call before the
    next one started (the server's thread answering within the caller's GIL slice, no await
    yielding), and six in a row took the loop's connections (0 hops: a CI run under load)."""
    async with KVStoreClient(server.address, ns) as client:
        keys = await stored(client, layout, 3)
        _socket_calls, hops = spy(monkeypatch)
        arrived, all_in = threading.Semaphore(0), threading.Event()
        real = Gate.lookup

        def held(gate: Gate, *args: Any, **kwargs: Any) -> Any:
            arrived.release()
            all_in.wait(10.0)
            return real(gate, *args, **kwargs)

        def count() -> None:
            for _ in range(6):
                arrived.acquire(timeout=10.0)
            all_in.set()

        monkeypatch.setattr(Gate, "lookup", held)
        counter = threading.Thread(target=count)
        counter.start()
        try:
            hits = await asyncio.gather(*(client.lookup_keys(keys) for _ in range(6)))
        finally:
            all_in.set()
            counter.join()
        assert [h.num_pages for h in hits] == [3] * 6
        assert len(hops) == 6 - 2, "two on this loop's connections, the others through the runtime"


async def test_close_retires_the_channel_of_every_loop(server, ns: Namespace, layout: KVLayout) -> None:
    path = str(server.call_socket.path)
    client = KVStoreClient(server.address, ns)
    await client.connect()
    keys = await stored(client, layout, 2)
    looked, closed, done = threading.Event(), threading.Event(), []

    async def other_loop() -> None:
        assert (await client.lookup_keys(keys)).num_pages == 2
        looked.set()
        while not closed.is_set():
            await asyncio.sleep(0.01)  # this loop runs on while the client closes
        try:
            await client.lookup_keys(keys)
        except KVStoreError as exc:
            done.append(str(exc))

    thread = threading.Thread(target=asyncio.run, args=(other_loop(),))
    thread.start()
    assert await asyncio.to_thread(looked.wait, 10)
    assert (await client.lookup_keys(keys)).num_pages == 2
    await client.close()
    closed.set()
    await asyncio.to_thread(thread.join, 10)
    assert done and "closed" in done[0], done
    with pytest.raises(KVStoreError, match="closed"):
        await client.lookup_keys(keys)
    assert await asyncio.to_thread(wait_for, lambda: connections_to(path) == 0), "a call socket connection was left open"


async def test_a_closed_client_leaves_nothing_held_by_a_loop_that_runs_on(server, ns: Namespace, layout: KVLayout) -> None:
    """A loop that outlives its clients (an engine's main loop, a client per job) holds none
    of them: a closed client's loop channel, and its runtime, are freed with it."""
    client = KVStoreClient(server.address, ns)
    await client.connect()
    keys = await stored(client, layout, 2)
    assert (await client.lookup_keys(keys)).num_pages == 2
    runtime = weakref.ref(client.runtime)
    await client.close()
    del client
    for _ in range(200):  # a wake-up the runtime thread scheduled on this loop may still hold it until the loop runs
        gc.collect()
        if runtime() is None:
            break
        await asyncio.sleep(0.01)
    assert runtime() is None, "a closed client's runtime is held (the loop's finalizer of its channel)"


async def test_learning_a_restarted_servers_socket_ends_within_the_callers_deadline(server_process: ServerProcess,
                                                                                    ns: Namespace) -> None:
    """A HELLO answered with another call token (the server restarted) makes the channel ask
    the server again over gRPC (relearn); that question is part of the call and ends at its
    deadline, not at gRPC's own timeout."""
    server_process.start()
    async with KVStoreClient(server_process.address, ns) as client:
        assert client.runtime.local is not None
        asked = asyncio.Event()

        async def slow_relearn() -> None:  # a gRPC GetInfo that does not answer in time
            asked.set()
            await asyncio.sleep(10)

        stale = AsyncCallChannel(client.runtime.local.path, None, bytes(16), slow_relearn)  # the token of no server
        request = directory_pb2.LookupRequest(namespace_id=client.namespace.namespace_id, keys=client.keys(list(range(16))))
        t0 = time.monotonic()
        with pytest.raises((NotSent, TimeoutError)):
            await stale.call("Directory.Lookup", request, 0.5)
        took = time.monotonic() - t0
        assert asked.is_set(), "the stale token made the channel ask again"
        assert took < 2.0, f"the call took {took:.1f} s with a 0.5 s deadline"


async def test_a_client_with_a_deadline_of_months_calls_over_the_call_socket(server, ns: Namespace, layout: KVLayout) -> None:
    """A deadline beyond the frame's u32 of milliseconds (~49.7 days; an operator's "no
    timeout") works on the call socket as it does over gRPC: every call of such a client,
    on any path, raised struct.error ("'I' format requires 0 <= number <= 4294967295")."""
    async with KVStoreClient(server.address, ns, timeout_s=1e7) as client:
        keys = await stored(client, layout, 2)  # Allocate / Commit on the runtime's call socket
        assert (await client.lookup_keys(keys)).num_pages == 2  # this loop's channel
        assert (await asyncio.to_thread(asyncio.run, client.lookup_keys(keys))).num_pages == 2  # another loop's
        assert client.calls.blocking is not None
        who = await asyncio.to_thread(client.calls.blocking.call, "Data.WhoAmI", data_pb2.WhoAmIRequest(), data_pb2.WhoAmIResponse)
        assert who.tenant  # the blocking channel


async def test_closed_loops_still_referenced_leave_their_places_and_connections(server, ns: Namespace, layout: KVLayout,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop closed but still referenced (kept by a thread-local, a list of an engine's
    workers) runs nothing again. Bug: its channel kept one of the MAX_LOOPS places and its
    connections open on the server until the loop was collected: after four such loops every
    other loop's lookups hopped to the runtime."""
    from kvstore.client import calls

    async with KVStoreClient(server.address, ns) as client:
        keys = await stored(client, layout, 2)
        path = str(server.call_socket.path)
        before = connections_to(path)
        kept: list[asyncio.AbstractEventLoop] = []

        def on_a_loop_of_its_own() -> None:
            loop = asyncio.new_event_loop()
            try:
                assert loop.run_until_complete(client.lookup_keys(keys)).num_pages == 2
            finally:
                loop.close()
            kept.append(loop)

        for _ in range(calls.MAX_LOOPS):
            await asyncio.to_thread(on_a_loop_of_its_own)
        _socket_calls, hops = spy(monkeypatch)
        assert (await client.lookup_keys(keys)).num_pages == 2
        assert hops == [], "this loop's lookup went through the runtime: the closed loops held every place"
        assert await asyncio.to_thread(wait_for, lambda: connections_to(path) == before + 1), \
            f"{connections_to(path) - before - 1} connections of closed loops left open on the server"
        assert len(kept) == calls.MAX_LOOPS
