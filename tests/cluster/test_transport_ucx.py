"""The UCX page transport between two processes on loopback: bit-exact pages into
shared-memory slots, missing pages reported per key, a page damaged at the sender never
sent, and a sender killed or stopped mid-transfer costing the receiver only the pages not
yet arrived, within its deadline, with no byte landing after fetch returns."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from fetch_contract import (
    NS,
    SENTINEL,
    Arena,
    Child,
    check_fetch_from_an_offset,
    check_killed_sender,
    check_queued_fetch_keeps_its_deadline,
    check_stopped_sender,
    key,
    page_servers,
    start_server,
    untouched,
)
from page_server_node import expected_page

from kvstore.bench.common.harness import KILL_WAIT_S
from kvstore.cluster.transport_ucx import FetchStatus, SourcePage, UcxConfig, UcxPageFetcher, UcxPageServer, init_ucx
from kvstore.errors import InvalidRequest
from kvstore.page import checksum
from kvstore.page_wire.fetch_frames import FetchRequest

HERE = Path(__file__).parent
TCP = UcxConfig(tls="tcp", progress_mode="blocking")  # "remote" really crosses a socket
LATE_S, SETTLE_S = 2.5, 0.0  # a stopped sender: how late fetch may return (the abort's wait), no settling


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena(256 << 20)
    yield a
    a.close()


@pytest.fixture
async def servers() -> AsyncIterator[Callable[[int], Awaitable[Child]]]:
    async with page_servers("tcp", "blocking") as start:
        yield start


@pytest.fixture
async def server(servers: Callable[[int], Awaitable[Child]]) -> Child:
    return await servers(256 << 10)


async def test_a_fetch_from_an_offset_sends_each_pages_rest(server: Child, arena: Arena) -> None:
    page = 256 << 10
    fetcher = UcxPageFetcher("127.0.0.1", server.port, TCP)
    dests = arena.slots(page, 4)
    for d in dests:
        np.frombuffer(d, np.uint8)[:] = SENTINEL
    await check_fetch_from_an_offset(fetcher, dests, page)
    await fetcher.close()


async def test_pages_land_bit_exact_in_arena_slots(server: Child, arena: Arena) -> None:
    page = 256 << 10
    keys = [key(0), key(1), key(2, first=0xFF), key(3), key(5)]
    dests = arena.slots(page, len(keys))
    fetcher = UcxPageFetcher("127.0.0.1", server.port, TCP)
    result = await fetcher.fetch(NS, keys, dests, timeout_s=20)
    assert result.statuses == [FetchStatus.OK, FetchStatus.OK, FetchStatus.MISSING, FetchStatus.OK, FetchStatus.OK]
    assert result.prefix == 2 and result.error is None
    for i in (0, 1, 3, 4):
        assert np.array_equal(np.frombuffer(dests[i], np.uint8), expected_page(keys[i], page))
    assert untouched(dests[2])  # a missing page is never sent
    # the connection is reused for the next request
    again = await fetcher.fetch(NS, [key(9)], [dests[2]], timeout_s=20)
    assert again.statuses == [FetchStatus.OK]
    await fetcher.close()


async def test_a_page_damaged_at_the_sender_is_never_sent(server: Child, arena: Arena) -> None:
    """Unasked, the sender posts page 3 as it is and the receiver finds it CORRUPT (never OK).
    Asked to verify (what a receiver does next: remote.py), the sender finds its bytes do not
    match its stored checksum before it posts its send, reports it damaged (the tier
    quarantines it) and drops the connection after the pages before it went out; the receiver
    gets those and FAILED for the rest (never CORRUPT: no byte of it arrived), and the next
    fetch reconnects."""
    page = 256 << 10
    keys = [key(1), key(2), key(3, first=0xEE), key(4)]
    fetcher = UcxPageFetcher("127.0.0.1", server.port, TCP)
    slots = arena.slots(page, 2 * len(keys))
    unasked = await fetcher.fetch(NS, keys, slots[len(keys):], timeout_s=20)
    assert unasked.statuses == [FetchStatus.OK, FetchStatus.OK, FetchStatus.CORRUPT, FetchStatus.OK] and unasked.error is None
    dests = slots[: len(keys)]
    result = await fetcher.fetch(NS, keys, dests, timeout_s=20, verify=True)
    assert result.statuses == [FetchStatus.OK, FetchStatus.OK, FetchStatus.FAILED, FetchStatus.FAILED] and result.error
    assert await server.line_starting("damaged") == f"damaged {keys[2].hex()}"
    for i in (0, 1):
        assert np.array_equal(np.frombuffer(dests[i], np.uint8), expected_page(keys[i], page))
    assert untouched(dests[2]) and untouched(dests[3])
    assert (await fetcher.fetch(NS, [key(5)], [dests[3]], timeout_s=20)).statuses == [FetchStatus.OK]  # reconnects
    await fetcher.close()


async def test_sender_killed_mid_transfer_costs_only_the_rest(arena: Arena, servers: Callable[[int], Awaitable[Child]]) -> None:
    """The sender dies (SIGKILL) 5 ms into a 200 MiB answer (fetch_contract.check_killed_sender)."""
    page = 1 << 20
    child = await servers(page)
    await check_killed_sender(UcxPageFetcher("127.0.0.1", child.port, TCP), child, arena.slots(page, 200), page)


async def test_stopped_sender_hits_the_deadline_and_no_late_byte_lands(arena: Arena,
                                                                       servers: Callable[[int], Awaitable[Child]]) -> None:
    """The sender freezes (SIGSTOP) mid-answer (fetch_contract.check_stopped_sender)."""
    page = 1 << 20
    child = await servers(page)
    await check_stopped_sender(UcxPageFetcher("127.0.0.1", child.port, TCP), child, arena.slots(page, 200), page, LATE_S, SETTLE_S)


async def test_a_fetch_queued_behind_a_frozen_one_keeps_its_own_deadline(arena: Arena,
                                                                        servers: Callable[[int], Awaitable[Child]]) -> None:
    """One connection per peer: a second fetch waits for it (fetch_contract.check_queued_fetch_keeps_its_deadline)."""
    page = 1 << 20
    child = await servers(page)
    await check_queued_fetch_keeps_its_deadline(UcxPageFetcher("127.0.0.1", child.port, TCP), child, arena.slots(page, 200),
                                                page, LATE_S)


async def test_unreachable_server_and_bad_arguments() -> None:
    fetcher = UcxPageFetcher("127.0.0.1", 1, TCP)  # nothing listens on port 1
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


async def test_a_garbage_frame_drops_only_that_connection(server: Child) -> None:
    import ucxx

    init_ucx(TCP)
    ep = await ucxx.create_endpoint("127.0.0.1", server.port)
    await ep.send(np.array([40], dtype=np.uint64))
    await ep.send(np.zeros(40, dtype=np.uint8))
    ep.abort()
    fetcher = UcxPageFetcher("127.0.0.1", server.port, TCP)
    result = await fetcher.fetch(NS, [key(1)], [bytearray(256 << 10)], timeout_s=20)
    assert result.statuses == [FetchStatus.OK]
    await fetcher.close()


@pytest.mark.parametrize("tls", ["tcp", "sm,self,tcp"])
def test_two_processes_bit_exact_over(tls: str) -> None:
    """Both ends in child processes, so each transport gets a fresh UCX (it reads UCX_TLS once)."""
    page = 2_359_296
    server = subprocess.Popen([sys.executable, str(HERE / "page_server_node.py"), str(page), tls, "blocking"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        out = subprocess.run([sys.executable, str(HERE / "page_fetch_node.py"), port, str(page), "8", tls, "blocking"],
                             check=False, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(HERE)})
        assert out.stdout.strip() == "ok 8", out.stdout + out.stderr[-2000:]
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(KILL_WAIT_S)


class CountingSource:
    """Serves zero pages and counts pins, so a test can see that none is left behind."""

    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self.pinned = 0
        self.opened = asyncio.Event()
        self.all_released = asyncio.Event()

    async def open_pages(self, namespace_id: bytes, keys: Sequence[bytes], generation: int = 0) -> list[SourcePage | None]:
        def release() -> None:
            self.pinned -= 1
            if self.pinned == 0:
                self.all_released.set()

        self.pinned += len(keys)
        self.opened.set()
        data = np.zeros(self.page_bytes, np.uint8)
        return [SourcePage(data, checksum(data), release) for _ in keys]


async def test_a_fetcher_that_stops_reading_does_not_pin_pages_forever() -> None:
    """A peer that asks and then never takes the bytes: the server gives up after its send
    timeout, drops the connection, and releases every page it had pinned for the answer."""
    import ucxx

    source = CountingSource(1 << 20)
    server = UcxPageServer(source, TCP, send_timeout_s=1.0)
    port = await server.start()
    ep = await ucxx.create_endpoint("127.0.0.1", port)
    body = FetchRequest(1, NS, 1 << 20, tuple(key(i) for i in range(8))).encode()
    await ep.send(np.array([len(body)], dtype=np.uint64))
    await ep.send(np.frombuffer(body, np.uint8))
    await asyncio.wait_for(source.opened.wait(), 10)
    await asyncio.wait_for(source.all_released.wait(), 1.0 + 4)
    assert source.pinned == 0
    ep.abort()
    await server.close()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def test_an_idle_connection_leaves_a_thread_mode_server_idle() -> None:
    """Bug: in ucxx's thread progress mode (the one kvstore-server runs) a receive was awaited
    by spinning the event loop (``asyncio.sleep(0)`` until done: ucxx's default without its
    notifier thread), so a page server with one open connection, waiting for the next
    request, burned ~40% of a core for as long as the connection stayed open; seen as 1.17 s
    of CPU in 3 idle seconds, and it slowed every lookup and fetch on that node's loop."""
    child = await start_server(4096, "tcp", "thread")
    try:
        fetcher = UcxPageFetcher("127.0.0.1", child.port, TCP)
        result = await fetcher.fetch(NS, [key(1)], [np.zeros(4096, np.uint8)], 30)
        assert result.statuses == [FetchStatus.OK]
        before = _cpu_s(child.proc.pid)
        await asyncio.sleep(3)
        busy = _cpu_s(child.proc.pid) - before
        await fetcher.close()
        assert busy < 0.3, f"the idle page server used {busy:.2f} s of CPU in 3 s"
    finally:
        child.proc.kill()
        await child.proc.wait()


async def test_anyone_holding_every_hello_slot_does_not_lock_a_node_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Anyone who reaches the data port (no grant needed) could keep MAX_ADMITTING silent
    endpoints open: every node's new connection was refused meanwhile, its fetch FAILED. A
    connection past the cap supersedes the oldest still presenting its grant (a node sends
    its hello right after connecting), as on the TCP plane."""
    import ucxx

    from kvstore.cluster import transport_ucx
    from kvstore.cluster.grants import TransferGrants

    monkeypatch.setattr(transport_ucx, "MAX_ADMITTING", 4)
    grants = TransferGrants()
    server = UcxPageServer(CountingSource(4096), TCP, authorize=grants.take)
    port = await server.start()
    silent = [await ucxx.create_endpoint("127.0.0.1", port) for _ in range(transport_ucx.MAX_ADMITTING)]
    try:
        await asyncio.sleep(0.5)  # every one accepted, presenting nothing
        grant = grants.issue("b")

        async def present() -> bytes:
            return grant

        fetcher = UcxPageFetcher("127.0.0.1", port, TCP, present)
        result = await fetcher.fetch(NS, [key(1)], [bytearray(4096)], timeout_s=5)
        await fetcher.close()
        assert result.statuses == [FetchStatus.OK], f"the node was locked out: {result.error}"
    finally:
        for ep in silent:
            ep.abort()
        await server.close()
