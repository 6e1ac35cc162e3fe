"""A client whose server restarted takes the restarted server's call socket and arena again
(client/restart.py): the blocking channel and the asyncio one learn its new ``call_token``
over gRPC (at most once a second) instead of failing, or falling back to gRPC, for good."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.kv import random_kv
from support.servers import ServerProcess

from kvstore import KVLayout, Namespace
from kvstore._proto import data_pb2
from kvstore.callsocket.client_aio import AsyncCallChannel
from kvstore.client import KVStoreClient
from kvstore.client.runtime import Runtime
from kvstore.page import checksum


def served(calls: list[str], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (the real AsyncCallChannel.call, set on the class: the runtime's channel and the
    caller loop's that lookups take, client/calls.py), noting the method of each call it answered."""

    async def spy(channel: AsyncCallChannel, method: str, *args: Any, **kw: Any) -> Any:
        answer = await fn(channel, method, *args, **kw)
        calls.append(method)
        return answer

    return spy


def grpc_unary(calls: list[str], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a real Runtime.rpc), noting the name of each unary call made over gRPC."""

    async def spy(method: Any, *args: Any, **kw: Any) -> Any:
        calls.append(str(getattr(method, "_method", method)))
        return await fn(method, *args, **kw)

    return spy


async def test_the_async_client_takes_a_restarted_servers_call_socket_and_arena_again(
        server_process: ServerProcess, ns: Namespace, layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: once the socket answered with another server's call_token (a restart), the async
    channel retired itself: every unary call went over gRPC for the client's lifetime."""
    server_process.start()
    tokens = torch.arange(2 * layout.page_tokens)
    kv = random_kv(layout, len(tokens))
    async with KVStoreClient(server_process.address, ns, timeout_s=5.0) as client:
        assert client.runtime.local is not None and client.shared_memory
        assert await client.put(tokens, kv, durable=True) == len(tokens)
        server_process.kill()
        server_process.start()
        socket_calls: list[str] = []
        grpc_calls: list[str] = []
        monkeypatch.setattr(AsyncCallChannel, "call", served(socket_calls, AsyncCallChannel.call))
        client.runtime.rpc = grpc_unary(grpc_calls, client.runtime.rpc)  # type: ignore[method-assign]
        hit = await client.lookup(tokens)
        assert hit.num_tokens == len(tokens)
        assert socket_calls == ["Directory.Lookup"], f"after the restart: socket {socket_calls}, gRPC {grpc_calls}"
        assert [c for c in grpc_calls if "GetInfo" not in c] == [], grpc_calls  # only the call token learnt again
        into = torch.zeros_like(kv)
        assert await client.get(hit, into) == len(tokens)  # the durable pages, through the new server's arena
        assert torch.equal(into, kv)
        more = torch.arange(100, 100 + 2 * layout.page_tokens)
        more_kv = random_kv(layout, len(more), seed=1)
        assert await client.put(more, more_kv) == len(more)
        into = torch.zeros_like(more_kv)
        assert await client.get(await client.lookup(more), into) == len(more)
        assert torch.equal(into, more_kv)
        assert {"Data.Allocate", "Data.Commit", "Data.Acquire"} <= set(socket_calls)
        assert [c for c in grpc_calls if "GetInfo" not in c] == [], grpc_calls
    async with KVStoreClient(server_process.address, ns, timeout_s=5.0) as fresh:  # the pages are in the server's arena
        into = torch.zeros_like(more_kv)
        assert await fresh.get(await fresh.lookup(more), into) == len(more)
        assert torch.equal(into, more_kv), "the put after the restart wrote into the old server's arena"


async def test_the_blocking_call_channel_reaches_a_restarted_server(server_process: ServerProcess, ns: Namespace,
                                                                    layout: KVLayout) -> None:
    """Bug: after a restart every call of the blocking channel (the vLLM connector's hit path)
    raised 'call socket ... belongs to another server' for the client's lifetime."""
    server_process.start()
    tokens = torch.arange(2 * layout.page_tokens)
    kv = random_kv(layout, len(tokens))
    async with KVStoreClient(server_process.address, ns, timeout_s=5.0) as client:
        calls = client.calls.blocking
        assert calls is not None
        assert await client.put(tokens, kv, durable=True) == len(tokens)
        before = calls.call("Data.GetInfo", data_pb2.GetInfoRequest(), data_pb2.GetInfoResponse).call_token
        server_process.kill()
        server_process.start()
        info = await asyncio.to_thread(calls.call, "Data.GetInfo", data_pb2.GetInfoRequest(), data_pb2.GetInfoResponse)
        assert info.call_token != before, "the restarted server answered over the socket"
        request = data_pb2.AcquireRequest(namespace_id=client.namespace.namespace_id, keys=client.keys(tokens),
                                          ttl_ms=client.lease_ms)
        acq = await asyncio.to_thread(calls.call, "Data.Acquire", request, data_pb2.AcquireResponse)
        assert len(acq.pages) == 2
        arena, n = client.arena, layout.page_bytes
        assert arena is not None
        assert [checksum(arena.array[p.offset : p.offset + n]) for p in acq.pages] == [p.checksum for p in acq.pages], \
            "the lease's pages read through the client's arena: the new server's"
        calls.call("Data.Release", data_pb2.ReleaseRequest(lease_id=acq.lease_id), data_pb2.ReleaseResponse)
        started = time.monotonic()
        server_process.kill()
        server_process.start()
        server_process.kill()
        server_process.start()
        assert calls.call("Data.GetInfo", data_pb2.GetInfoRequest(), data_pb2.GetInfoResponse).call_token
        assert time.monotonic() - started < 30


def _mapped(address: int) -> bool:
    """Whether this process has a mapping that starts at ``address``."""
    with open("/proc/self/maps") as maps:
        return any(int(line.split("-", 1)[0], 16) == address for line in maps)


async def test_the_dead_servers_arena_is_unmapped_once_the_new_one_is_taken(
        server_process: ServerProcess, ns: Namespace, layout: KVLayout) -> None:
    """Bug: the old mapping was kept until the client closed. The restarted server unlinked
    the old arena file (a tenant's arena is a memfd), so the client's mapping was the last
    holder of the dead server's whole arena: its RAM stayed taken beside the new arena's, one
    more arena per restart, for the client's lifetime."""
    server_process.start()
    tokens = torch.arange(2 * layout.page_tokens)
    kv = random_kv(layout, len(tokens))
    async with KVStoreClient(server_process.address, ns, timeout_s=5.0) as client:
        assert client.arena is not None
        assert await client.put(tokens, kv, durable=True) == len(tokens)
        old = int(client.arena.array.ctypes.data)
        assert _mapped(old)
        server_process.kill()
        server_process.start()
        into = torch.zeros_like(kv)
        assert await client.get(await client.lookup(tokens), into) == len(tokens)  # through the new arena
        assert torch.equal(into, kv)
        assert client.arena is not None and int(client.arena.array.ctypes.data) != old
        assert not _mapped(old), "the dead server's arena is still mapped by the client"



async def test_a_client_sizes_its_batches_by_the_restarted_servers_arena(server_process: ServerProcess, ns: Namespace,
                                                                         layout: KVLayout) -> None:
    """A batch of a put or get is at most a sixth of the arena, so that the batches in flight
    fit it. Stale state: the client kept the arena size of the server it first met
    (ShmTransport.arena_bytes, not updated by the remap), so after a restart with a smaller
    --host-capacity its batches were sized for the old arena (64 pages, not 21). The server
    coped (a put of 120 pages into the 128-slot arena, two concurrent puts of 64 pages, were
    still whole and exact): the size now comes from the arena mapped, one source of truth."""
    server_process.start()
    async with KVStoreClient(server_process.address, ns, timeout_s=10.0) as client:
        tokens = torch.arange(2 * layout.page_tokens)
        assert await client.put(tokens, random_kv(layout, len(tokens)), durable=True) == len(tokens)
        transport = client._transport
        assert transport is not None and transport.batch_pages() == 64, "a 64 MiB arena: full batches"
        server_process.kill()
        server_process.args[server_process.args.index("--host-capacity") + 1] = "4MiB"
        server_process.start()
        assert (await client.lookup(tokens)).num_tokens == len(tokens)  # the durable pages; the new arena is mapped
        assert transport.batch_pages() == (4 << 20) // layout.page_bytes // 6, "sized by the new server's 4 MiB arena"
        more = torch.arange(1000, 1000 + 96 * layout.page_tokens)  # 3 MiB: most of the new arena
        kv = random_kv(layout, len(more), seed=2)
        assert await client.put(more, kv) == len(more)
        into = torch.zeros_like(kv)
        assert await client.get(await client.lookup(more), into) == len(more)
        assert torch.equal(into, kv)


async def test_connections_left_idle_by_calls_side_by_side_do_not_fail_the_first_call_after_a_restart(
        server_process: ServerProcess, ns: Namespace, layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls side by side leave a channel several idle connections, all closed by a restart.
    Bug: a call tried one of them, then one more, and gave up: the blocking channel (the vLLM
    connector's hit path) raised 'call socket ...: [Errno 32] Broken pipe', and a lookup on the
    caller's loop went through the runtime (its loop channel then refused the socket for 1 s)."""
    server_process.start()
    tokens = torch.arange(2 * layout.page_tokens)
    async with KVStoreClient(server_process.address, ns, timeout_s=5.0) as client:
        calls = client.calls.blocking
        assert calls is not None
        assert await client.put(tokens, random_kv(layout, len(tokens)), durable=True) == len(tokens)
        keys = client.keys(tokens)
        at_once = threading.Barrier(3)

        def get_info() -> None:
            at_once.wait(10)
            calls.call("Data.GetInfo", data_pb2.GetInfoRequest(), data_pb2.GetInfoResponse)

        threads = [threading.Thread(target=get_info) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            await asyncio.to_thread(thread.join, 10)
        assert [h.num_pages for h in await asyncio.gather(client.lookup_keys(keys), client.lookup_keys(keys))] == [2, 2]
        server_process.kill()
        server_process.start()
        info = await asyncio.to_thread(calls.call, "Data.GetInfo", data_pb2.GetInfoRequest(), data_pb2.GetInfoResponse)
        assert info.call_token
        socket_calls: list[str] = []
        hops: list[str] = []
        monkeypatch.setattr(AsyncCallChannel, "call", served(socket_calls, AsyncCallChannel.call))
        real_hop = Runtime.call

        async def hop(runtime: Runtime, coro: Any) -> Any:
            hops.append(coro.__qualname__)
            return await real_hop(runtime, coro)

        monkeypatch.setattr(Runtime, "call", hop)
        assert (await client.lookup_keys(keys)).num_pages == 2
        assert [h for h in hops if "call_socket" not in h] == [], "the lookup went through the runtime"
        assert socket_calls == ["Directory.Lookup"]
