"""The TCP page transport between two processes on loopback, held to the UCX plane's
contract: bit-exact pages into shared-memory slots, missing pages reported per key, a page
damaged at the sender never sent whole, a byte flipped in flight never reported OK, and a
sender killed or stopped mid-transfer costing the receiver only the pages not yet arrived,
within its deadline, with no byte landing after fetch returns."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from fetch_contract import (
    SENTINEL,
    Arena,
    Child,
    check_fetch_from_an_offset,
    check_killed_sender,
    check_queued_fetch_keeps_its_deadline,
    check_stopped_sender,
    page_servers,
)
from page_server_node import expected_page
from support.tcp_proxy import TcpProxy
from test_transport_ucx import NS, CountingSource, _cpu_s, key, untouched

from kvstore.cluster.page_fetch import FetchStatus
from kvstore.cluster.tcp_socket import Deadline, send_frame
from kvstore.cluster.transport_tcp import TcpPageFetcher, TcpPageServer
from kvstore.errors import InvalidRequest
from kvstore.page_wire.fetch_frames import FetchAnswer, FetchRequest, PageEntry, PageStatus

HERE = Path(__file__).parent
LATE_S, SETTLE_S = 0.5, 0.5  # a stopped sender: how late fetch may return; stray bytes get 0.5 s to land before the check


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena(256 << 20)
    yield a
    a.close()


@pytest.fixture
async def servers() -> AsyncIterator[Callable[[int], Awaitable[Child]]]:
    async with page_servers("-", "-", "tcp") as start:
        yield start


async def test_pages_land_bit_exact_in_arena_slots(servers: Callable[[int], Awaitable[Child]], arena: Arena) -> None:
    page = 256 << 10
    server = await servers(page)
    keys = [key(0), key(1), key(2, first=0xFF), key(3), key(5)]
    dests = arena.slots(page, len(keys) + 1)
    fetcher = TcpPageFetcher("127.0.0.1", server.port)
    result = await fetcher.fetch(NS, keys, dests[:5], timeout_s=20)
    assert result.statuses == [FetchStatus.OK, FetchStatus.OK, FetchStatus.MISSING, FetchStatus.OK, FetchStatus.OK]
    assert result.prefix == 2 and result.error is None
    for i in (0, 1, 3, 4):
        assert np.array_equal(np.frombuffer(dests[i], np.uint8), expected_page(keys[i], page))
    assert untouched(dests[2])  # a missing page is never sent
    again = await fetcher.fetch(NS, [key(9)], [dests[5]], timeout_s=20)  # the connection is reused
    assert again.statuses == [FetchStatus.OK]
    await fetcher.close()


async def test_a_fetch_from_an_offset_sends_each_pages_rest(servers: Callable[[int], Awaitable[Child]], arena: Arena) -> None:
    page = 256 << 10
    server = await servers(page)
    fetcher = TcpPageFetcher("127.0.0.1", server.port)
    dests = arena.slots(page, 4)
    for d in dests:
        np.frombuffer(d, np.uint8)[:] = SENTINEL
    await check_fetch_from_an_offset(fetcher, dests, page)
    await fetcher.close()


async def test_a_page_damaged_at_the_sender_is_never_sent_whole(servers: Callable[[int], Awaitable[Child]], arena: Arena) -> None:
    """Unasked, the sender sends page 2 as it is and the receiver finds it CORRUPT (never OK).
    Asked to verify (what a receiver does next: remote.py), the sender finds its bytes do not
    match its stored checksum before its last chunk leaves, reports it damaged (the tier
    quarantines it) and drops the connection; the receiver gets page 1 and FAILED for the rest,
    and the slot of the damaged page never holds a page that could pass for it."""
    page = 1 << 20
    server = await servers(page)
    keys = [key(1), key(2, first=0xEE), key(3)]
    slots = arena.slots(page, 6)
    fetcher = TcpPageFetcher("127.0.0.1", server.port)
    unasked = await fetcher.fetch(NS, keys, slots[3:], timeout_s=20)
    assert unasked.statuses == [FetchStatus.OK, FetchStatus.CORRUPT, FetchStatus.OK] and unasked.error is None
    dests = slots[:3]
    result = await fetcher.fetch(NS, keys, dests, timeout_s=20, verify=True)
    assert result.statuses == [FetchStatus.OK, FetchStatus.FAILED, FetchStatus.FAILED] and result.error
    assert await server.line_starting("damaged") == f"damaged {keys[1].hex()}"
    assert untouched(dests[1][-(256 << 10):]) and untouched(dests[2])  # its last chunk never left
    assert (await fetcher.fetch(NS, [key(4)], [dests[2]], timeout_s=20)).statuses == [FetchStatus.OK]  # reconnects
    await fetcher.close()


async def test_a_byte_flipped_in_flight_is_caught(servers: Callable[[int], Awaitable[Child]], arena: Arena) -> None:
    """A relay between the nodes flips one byte inside page 2's payload: that page is
    CORRUPT (never OK), the pages around it arrive bit-exact."""
    page = 1 << 20
    server = await servers(page)
    keys = [key(i) for i in range(3)]
    answer = 8 + len(FetchAnswer(1, (PageEntry(PageStatus.FOUND, page, 0),) * len(keys)).encode())  # its length + the frame
    relay = TcpProxy(("127.0.0.1", server.port), flip_at=answer + page + page // 2)
    try:
        dests = arena.slots(page, 3)
        fetcher = TcpPageFetcher("127.0.0.1", relay.port)
        result = await fetcher.fetch(NS, keys, dests, timeout_s=20)
        assert result.statuses == [FetchStatus.OK, FetchStatus.CORRUPT, FetchStatus.OK]
        assert result.prefix == 1
        for i in (0, 2):
            assert np.array_equal(np.frombuffer(dests[i], np.uint8), expected_page(keys[i], page))
        await fetcher.close()
    finally:
        relay.close()


async def test_sender_killed_mid_transfer_costs_only_the_rest(arena: Arena, servers: Callable[[int], Awaitable[Child]]) -> None:
    """The sender dies (SIGKILL) 5 ms into a 200 MiB answer (fetch_contract.check_killed_sender)."""
    page = 1 << 20
    child = await servers(page)
    await check_killed_sender(TcpPageFetcher("127.0.0.1", child.port), child, arena.slots(page, 200), page)


async def test_stopped_sender_hits_the_deadline_and_no_late_byte_lands(arena: Arena,
                                                                       servers: Callable[[int], Awaitable[Child]]) -> None:
    """The sender freezes (SIGSTOP) mid-answer (fetch_contract.check_stopped_sender)."""
    page = 1 << 20
    child = await servers(page)
    await check_stopped_sender(TcpPageFetcher("127.0.0.1", child.port), child, arena.slots(page, 200), page, LATE_S, SETTLE_S)


async def test_a_fetch_queued_behind_a_frozen_one_keeps_its_own_deadline(arena: Arena,
                                                                        servers: Callable[[int], Awaitable[Child]]) -> None:
    """One connection per peer: a second fetch waits for it (fetch_contract.check_queued_fetch_keeps_its_deadline)."""
    page = 1 << 20
    child = await servers(page)
    await check_queued_fetch_keeps_its_deadline(TcpPageFetcher("127.0.0.1", child.port), child, arena.slots(page, 200), page,
                                                LATE_S)


async def test_a_cancelled_fetch_returns_only_after_its_receives_stopped(arena: Arena,
                                                                         servers: Callable[[int], Awaitable[Child]]) -> None:
    """The caller's task is cancelled mid-fetch (a runtime call past its deadline): the
    CancelledError reaches it only once the receiving thread stopped writing its buffers."""
    page, n = 1 << 20, 200
    child = await servers(page)
    dests = arena.slots(page, n)
    keys = [key(0, first=0xDC)] + [key(i) for i in range(1, n)]  # the sender freezes: the fetch would wait
    fetcher = TcpPageFetcher("127.0.0.1", child.port)
    task = asyncio.ensure_future(fetcher.fetch(NS, keys, dests, timeout_s=30))
    await asyncio.sleep(0.5)
    task.cancel()
    t0 = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - t0 < 2.5
    for d in dests:
        np.frombuffer(d, np.uint8)[:] = SENTINEL
    child.proc.send_signal(signal.SIGCONT)
    await asyncio.sleep(0.5)
    assert all(untouched(d) for d in dests)
    await fetcher.close()


async def test_unreachable_server_and_bad_arguments() -> None:
    fetcher = TcpPageFetcher("127.0.0.1", 1)  # nothing listens on port 1
    result = await fetcher.fetch(NS, [key(0)], [bytearray(16)], timeout_s=5)
    assert result.statuses == [FetchStatus.FAILED] and result.error
    with pytest.raises(InvalidRequest):
        await fetcher.fetch(NS, [key(0)], [bytes(16)], timeout_s=1)  # read-only destination
    with pytest.raises(InvalidRequest):
        await fetcher.fetch(NS, [key(0), key(1)], [bytearray(16), bytearray(8)], timeout_s=1)
    with pytest.raises(InvalidRequest):
        await fetcher.fetch(NS, [b"short"], [bytearray(16)], timeout_s=1)
    with pytest.raises(InvalidRequest):
        await fetcher.fetch(b"ns", [key(0)], [bytearray(16)], timeout_s=1)


async def test_garbage_drops_only_that_connection(servers: Callable[[int], Awaitable[Child]]) -> None:
    """A frame of zeros, then a frame claiming 2**60 bytes: each connection is dropped, the
    server keeps serving others."""
    server = await servers(256 << 10)
    for garbage in (struct.pack("<Q", 40) + bytes(40), struct.pack("<Q", 1 << 60)):
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            raw.sendall(garbage)
            raw.settimeout(10)
            assert raw.recv(1) == b""  # the server closed it
    fetcher = TcpPageFetcher("127.0.0.1", server.port)
    assert (await fetcher.fetch(NS, [key(1)], [bytearray(256 << 10)], timeout_s=20)).statuses == [FetchStatus.OK]
    await fetcher.close()


async def test_a_peer_answering_garbage_fails_the_fetch_in_time() -> None:
    """A "server" that answers a request with a malformed frame and then holds the
    connection open: the fetch fails at once with FAILED, not at its deadline."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> socket.socket:
        conn, _ = listener.accept()
        conn.recv(1 << 16)
        conn.sendall(struct.pack("<Q", 32) + b"KVFA" + bytes(28))
        return conn

    pending = asyncio.ensure_future(asyncio.to_thread(answer))
    fetcher = TcpPageFetcher("127.0.0.1", port)
    t0 = time.monotonic()
    result = await fetcher.fetch(NS, [key(1)], [bytearray(4096)], timeout_s=10)
    assert time.monotonic() - t0 < 5 and result.statuses == [FetchStatus.FAILED] and "InvalidRequest" in (result.error or "")
    (await pending).close()
    listener.close()
    await fetcher.close()


def ask_raw(port: int, page: int, n: int) -> socket.socket:
    """A bare connection with a 4 KiB receive buffer that has asked for ``n`` pages (framed as
    the transport frames: tcp_socket.send_frame) and reads nothing yet."""
    raw = socket.create_connection(("127.0.0.1", port))
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    send_frame(raw, FetchRequest(1, NS, page, tuple(key(i) for i in range(n))).encode(), Deadline(5))
    raw.settimeout(None)
    return raw


async def test_a_fetcher_that_stops_reading_does_not_pin_pages_forever() -> None:
    """A peer that asks and then never takes the bytes: the server gives up after its send
    timeout, drops the connection, and releases every page it had pinned for the answer."""
    source = CountingSource(1 << 20)
    server = TcpPageServer(source, send_timeout_s=1.0)
    port = await server.start()
    raw = ask_raw(port, 1 << 20, 64)
    await asyncio.wait_for(source.opened.wait(), 10)
    await asyncio.wait_for(source.all_released.wait(), 1.0 + 4)
    assert source.pinned == 0
    raw.close()
    await server.close()


async def test_an_idle_connection_leaves_the_server_idle(servers: Callable[[int], Awaitable[Child]]) -> None:
    child = await servers(4096)
    fetcher = TcpPageFetcher("127.0.0.1", child.port)
    assert (await fetcher.fetch(NS, [key(1)], [np.zeros(4096, np.uint8)], 30)).statuses == [FetchStatus.OK]
    before = _cpu_s(child.proc.pid)
    await asyncio.sleep(3)
    busy = _cpu_s(child.proc.pid) - before
    await fetcher.close()
    assert busy < 0.1, f"the idle page server used {busy:.2f} s of CPU in 3 s"


def test_sockets_get_cubic_and_no_delay() -> None:
    """DESIGN §12.3: loopback TCP with bbr (this machine's default) moves a third of cubic's bytes."""
    from kvstore.cluster.tcp_socket import tune

    with socket.socket() as s:
        tune(s)
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        if os.geteuid() == 0 or b"cubic" in Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_bytes():
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") == b"cubic"


async def test_the_data_port_serves_only_a_live_grant_once(caplog: pytest.LogCaptureFixture) -> None:
    """With ``authorize`` (TransferGrants.take, as a node runs it) a connection is served
    only after its hello presents a grant the node issued: none, a forged one, or one
    already used are refused and logged; a fresh one is served."""
    from kvstore.cluster.grants import TransferGrants

    source = CountingSource(4096)
    grants = TransferGrants()
    server = TcpPageServer(source, authorize=grants.take)
    port = await server.start()
    try:
        issued = grants.issue("b")

        async def fetch(grant: bytes | None) -> list[FetchStatus]:
            async def present() -> bytes:
                assert grant is not None
                return grant

            fetcher = TcpPageFetcher("127.0.0.1", port, None if grant is None else present)
            result = await fetcher.fetch(NS, [key(1)], [bytearray(4096)], timeout_s=5)
            await fetcher.close()
            return result.statuses

        assert await fetch(None) == [FetchStatus.FAILED]
        assert await fetch(os.urandom(16)) == [FetchStatus.FAILED]
        assert await fetch(issued) == [FetchStatus.OK]
        assert await fetch(issued) == [FetchStatus.FAILED]  # used up
        assert await fetch(grants.issue("b")) == [FetchStatus.OK]
        logged = caplog.text
        assert "refused a TCP connection to the data port: no grant" in logged
        assert "its grant is unknown, used or expired" in logged
    finally:
        await server.close()
    assert source.pinned == 0


async def test_silent_connections_are_bounded_and_dropped(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Connections that present nothing: at most MAX_ADMITTING wait for their hello (more
    supersede the oldest, logged), each is dropped after HELLO_TIMEOUT_S, and a node's own
    connection is still served meanwhile."""
    from kvstore.cluster import tcp_server
    from kvstore.cluster.grants import TransferGrants

    monkeypatch.setattr(tcp_server, "HELLO_TIMEOUT_S", 1.0)
    grants = TransferGrants()
    server = TcpPageServer(CountingSource(4096), authorize=grants.take)
    port = await server.start()
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(tcp_server.MAX_ADMITTING + 8)]
    try:
        started = time.monotonic()  # until the accept thread has taken them all in (each its own thread: slow under load)
        while "were presenting their grant; closed the oldest" not in caplog.text and time.monotonic() - started < 10:
            await asyncio.sleep(0.05)
        assert "were presenting their grant; closed the oldest" in caplog.text
        # a superseded connection is shut at once and forgotten when its thread sees it end (under load, a
        # moment later): the count falls to the cap, it does not pile up
        while server.connections() > tcp_server.MAX_ADMITTING and time.monotonic() - started < 10:
            await asyncio.sleep(0.05)
        assert server.connections() <= tcp_server.MAX_ADMITTING
        closed = 0
        for s in silent:
            s.settimeout(5)
            try:
                closed += s.recv(1) == b""
            except OSError:
                closed += 1
        assert closed == len(silent)  # each was dropped: past the cap at once, the rest after the hello deadline
        assert "no grant within" in caplog.text
        for _ in range(100):  # a thread ends its connection, then forgets it
            if server.connections() == 0:
                break
            await asyncio.sleep(0.02)
        assert server.connections() == 0
        grant = grants.issue("b")

        async def present() -> bytes:
            return grant

        fetcher = TcpPageFetcher("127.0.0.1", port, present)
        assert (await fetcher.fetch(NS, [key(1)], [bytearray(4096)], timeout_s=5)).statuses == [FetchStatus.OK]
        await fetcher.close()
    finally:
        for s in silent:
            s.close()
        await server.close()


def test_the_tcp_plane_imports_no_ucx() -> None:
    """A node on the TCP plane loads nothing of UCX (ucxx starts threads and reads its own
    configuration at import)."""
    code = ("import sys; import kvstore.cluster.transport_tcp, kvstore.server.cluster.peers, kvstore.server.cluster.source, "
            "kvstore.server.cluster.cluster_runtime; assert 'ucxx' not in sys.modules, 'ucxx loaded'")
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
