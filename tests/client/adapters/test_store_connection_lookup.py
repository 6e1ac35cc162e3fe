"""StoreConnection.num_stored, the synchronous engines' lookup (SGLang's batch_exists): over the
same-host call channel from the caller's thread, no hop to the client's runtime; a stalled server
ends it at the caller's bound; without the call socket it is a bounded run on the runtime."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import pytest
import torch
from support.kv import random_kv
from support.servers import ServerProcess

from kvstore import KVLayout, Namespace
from kvstore.client import KVStoreClient
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.runtime import Runtime


async def _put(address: str, ns: Namespace, layout: KVLayout, pages: int) -> list[bytes]:
    tokens = torch.arange(pages * layout.page_tokens)
    async with KVStoreClient(address, ns) as client:
        assert await client.put(tokens, random_kv(layout, len(tokens))) == len(tokens)
        return client.keys(tokens)


def _jobs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The coroutines handed to any client's runtime from now on."""
    jobs: list[Any] = []
    real = Runtime.submit

    def submit(runtime: Runtime, coro: Any) -> Any:
        jobs.append(coro)
        return real(runtime, coro)

    monkeypatch.setattr(Runtime, "submit", submit)
    return jobs


@pytest.mark.parametrize("use_call_socket", [True, False])
def test_num_stored_counts_the_stored_prefix(server, ns: Namespace, layout: KVLayout, use_call_socket: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    keys = asyncio.run(_put(server.address, ns, layout, 4))
    store = StoreConnection(server.address, ns, use_call_socket=use_call_socket)
    try:
        assert store.start()
        client = store.client()
        assert client is not None and (client.calls.blocking is not None) == use_call_socket
        jobs = _jobs(monkeypatch)
        assert store.num_stored(client, keys, 5.0) == 4
        assert store.num_stored(client, keys[:2] + [b"\0" * 16] + keys[3:], 5.0) == 2
        assert store.num_stored(client, [], 5.0) == 0
        assert len(jobs) == (0 if use_call_socket else 3), "over the call channel, no job for the runtime"
    finally:
        store.close()


def test_num_stored_on_a_stalled_server_ends_at_the_callers_bound(server_process: ServerProcess, ns: Namespace,
                                                                  layout: KVLayout) -> None:
    server_process.start()
    keys = asyncio.run(_put(server_process.address, ns, layout, 2))
    store = StoreConnection(server_process.address, ns)
    try:
        assert store.start()
        client = store.client()
        assert client is not None and client.calls.blocking is not None
        assert store.num_stored(client, keys, 5.0) == 2
        server_process.freeze()
        started = time.monotonic()
        try:
            with pytest.raises(TimeoutError):
                store.num_stored(client, keys, 0.5)
            assert time.monotonic() - started < 0.5 + 0.5
        finally:
            assert server_process.proc is not None
            server_process.proc.send_signal(signal.SIGCONT)
        assert store.num_stored(client, keys, 5.0) == 2
    finally:
        store.close()
