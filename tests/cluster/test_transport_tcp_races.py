"""The TCP plane's connection handling: races made certain rather than left to timing (a
connection accepted while the page server closes, a fetch cut off while it connects), and a
fetcher's connections (fetches side by side on their own, all closed by close())."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
import warnings
from typing import Any

import pytest
from test_transport_ucx import NS, CountingSource, key

from kvstore.cluster import transport_tcp
from kvstore.cluster.page_fetch import FetchStatus
from kvstore.cluster.transport_tcp import TcpPageFetcher, TcpPageServer


class _AcceptAfterClose:
    """The page server's lock (a real one), handed to the accept thread only once another
    thread has taken and released it: the interleaving where close() looks at the
    connections before the accept thread counts the one it has just accepted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.accept_waits = threading.Event()
        self.released_once = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if threading.current_thread().name == "tcp-pages-accept":
            self.accept_waits.set()
            self.released_once.wait(5)
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()
        if threading.current_thread().name != "tcp-pages-accept":
            self.released_once.set()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


async def test_a_connection_accepted_while_the_server_closes_is_closed_too() -> None:
    server = TcpPageServer(CountingSource(4096))
    lock = _AcceptAfterClose()
    server._lock, server._idle = lock, threading.Condition(lock)  # type: ignore[assignment]
    port = await server.start()
    client = socket.create_connection(("127.0.0.1", port))
    try:
        assert await asyncio.to_thread(lock.accept_waits.wait, 5)  # accepted, not yet counted
        t0 = time.monotonic()
        await server.close()
        waited = time.monotonic() - t0
        client.settimeout(2)
        try:
            ended = client.recv(1) == b""
        except TimeoutError:
            ended = False
        except OSError:  # reset
            ended = True
        assert ended, "the connection accepted during close() is still open after it"
        assert server.connections() == 0
        assert waited < 2, f"close() waited {waited:.1f} s for a connection it never ended"
    finally:
        client.close()


async def test_a_fetch_cancelled_while_connecting_closes_the_socket_its_thread_made() -> None:
    """The connect runs on a thread; a fetch cut off meanwhile (cancelled, or its deadline)
    must close the socket that thread still makes, not leave it to the GC."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    address = listener.getsockname()
    queued = []
    for _ in range(3):  # the accept queue full: the fetcher's SYN is dropped, its connect waits for a retransmit
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(address)
        queued.append(s)
    await asyncio.sleep(0.2)
    fetcher = TcpPageFetcher("127.0.0.1", address[1], connect_timeout_s=10)
    gc.collect()  # what earlier tests of this process left to the GC warns now, not in the window below
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        task = asyncio.ensure_future(fetcher.fetch(NS, [key(1)], [bytearray(4096)], timeout_s=10))
        await asyncio.sleep(0.4)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for s in queued:
            s.close()
        listener.settimeout(0.2)
        accepted = 0
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and accepted < 2:  # the queued one, then the fetcher's (on its SYN retransmit)
            try:
                conn, _ = await asyncio.to_thread(listener.accept)
            except TimeoutError:
                continue
            conn.close()
            accepted += 1
        await asyncio.sleep(0.3)  # the connect's thread returns its socket
        gc.collect()
        leaked = [w for w in seen if issubclass(w.category, ResourceWarning) and "socket" in str(w.message)
                  and f"{address[1]})" in str(w.message)]  # the fetcher's, to this listener (not another test's)
    listener.close()
    await fetcher.close()
    assert accepted == 2, "the fetcher's connect never completed: the race was not set up"
    assert not leaked, f"a socket left to the GC: {leaked[0].message}"


class _HeldSource(CountingSource):
    """Holds every request's pages until ``go`` is set: fetches that overlap, for certain."""

    def __init__(self, page_bytes: int) -> None:
        super().__init__(page_bytes)
        self.go = asyncio.Event()
        self.requests = 0

    async def open_pages(self, namespace_id: bytes, keys: Any, generation: int = 0) -> Any:
        self.requests += 1
        await self.go.wait()
        return await super().open_pages(namespace_id, keys, generation)


async def test_fetches_at_once_go_side_by_side_on_their_own_connections(monkeypatch: Any) -> None:
    monkeypatch.setattr(transport_tcp, "CONNECTIONS", 2)
    source = _HeldSource(4096)
    server = TcpPageServer(source)
    port = await server.start()
    fetcher = TcpPageFetcher("127.0.0.1", port)
    try:
        fetches = [asyncio.ensure_future(fetcher.fetch(NS, [key(i)], [bytearray(4096)], timeout_s=10)) for i in (1, 2, 3)]
        for _ in range(200):
            if source.requests == 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert source.requests == 2 and server.connections() == 2  # the third waits for a connection
        source.go.set()
        results = await asyncio.gather(*fetches)
        assert [r.statuses for r in results] == [[FetchStatus.OK]] * 3
        assert server.connections() == 2  # kept for the next fetches
    finally:
        await fetcher.close()
        for _ in range(100):
            if server.connections() == 0:
                break
            await asyncio.sleep(0.02)
        assert server.connections() == 0 and source.pinned == 0
        await server.close()
