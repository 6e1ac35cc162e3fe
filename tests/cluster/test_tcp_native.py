"""The TCP plane's page moves, native (one call per page, the GIL released: _sockhash.c) and
in Python (without the compiled module), held to one contract on real sockets: the same
bytes and checksums, a page that does not match its checksum never sent whole, a peer that
closes or goes silent reported as TransportError or TimeoutError by the deadline."""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from test_transport_ucx import NS, key

from kvstore.cluster import tcp_socket
from kvstore.cluster.cluster_errors import TransportError
from kvstore.cluster.page_fetch import FetchStatus, SourcePage
from kvstore.cluster.tcp_socket import Deadline, recv_hashed, send_hashed
from kvstore.cluster.transport_tcp import TcpPageFetcher, TcpPageServer
from kvstore.page import checksum
from kvstore.pagecopy import running_checksum

PAGE = (1 << 20) + 4096  # not a multiple of the chunk: the last chunk is short


@pytest.fixture(params=["native", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "python":
        monkeypatch.setattr(tcp_socket, "_native", None)
    elif tcp_socket._native is None:
        pytest.skip("kvstore._copyhash is not built")
    yield request.param


class RandomSource:
    """Distinct random pages; a key whose first byte is 0xEE is stored with a wrong checksum."""

    def __init__(self) -> None:
        self.damaged: list[bytes] = []

    async def open_pages(self, namespace_id: bytes, keys: Sequence[bytes], generation: int = 0) -> list[SourcePage | None]:
        pages: list[SourcePage | None] = []
        for k in keys:
            data = np.random.default_rng(k[1]).integers(0, 256, PAGE, dtype=np.uint8)
            pages.append(SourcePage(data, checksum(data) + (k[0] == 0xEE), damaged=lambda reason, k=k: self.damaged.append(k)))
        return pages


async def test_pages_arrive_bit_exact_and_a_damaged_page_is_caught_then_not_sent(path: str) -> None:
    source = RandomSource()
    server = TcpPageServer(source)
    port = await server.start()
    fetcher = TcpPageFetcher("127.0.0.1", port)
    try:
        keys = [key(i) for i in range(1, 4)]
        dests = [bytearray(PAGE) for _ in keys]
        result = await fetcher.fetch(NS, keys, dests, timeout_s=20)
        assert result.statuses == [FetchStatus.OK] * 3 and result.error is None
        for k, d, s in zip(keys, dests, result.checksums):
            expected = np.random.default_rng(k[1]).integers(0, 256, PAGE, dtype=np.uint8)
            assert bytes(d) == expected.tobytes() and s == checksum(expected)
        bad = [key(5), key(6, first=0xEE), key(7)]
        dests = [bytearray(PAGE) for _ in bad]
        result = await fetcher.fetch(NS, bad, dests, timeout_s=20)  # sent unhashed: the receiver's check catches it
        assert result.statuses == [FetchStatus.OK, FetchStatus.CORRUPT, FetchStatus.OK] and result.error is None
        assert source.damaged == []
        result = await fetcher.fetch(NS, bad, dests, timeout_s=20, verify=True)  # the sender checks: never sent
        assert result.statuses[0] is FetchStatus.OK and result.statuses[1:] == [FetchStatus.FAILED] * 2
        assert result.error is not None and source.damaged == [bad[1]]
    finally:
        await fetcher.close()
        await server.close()


class BlockingSource(RandomSource):
    """A ``BlockingPageSource``: the server must open it on its connection's thread, never through the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    async def open_pages(self, namespace_id: bytes, keys: Sequence[bytes], generation: int = 0) -> list[SourcePage | None]:
        raise AssertionError("opened through the event loop")

    def open_pages_now(self, namespace_id: bytes, keys: Sequence[bytes], generation: int = 0) -> list[SourcePage | None]:
        self.threads.append(threading.current_thread().name)
        return asyncio.run(RandomSource.open_pages(self, namespace_id, keys, generation))


async def test_a_source_that_may_block_is_opened_on_the_connection_thread(path: str) -> None:
    """DESIGN §12.7: the node's own source is opened where the request arrives; the hop to the
    server's loop and on to a worker thread and back cost a handoff ~0.5-2 ms of its fixed cost."""
    source = BlockingSource()
    server = TcpPageServer(source)
    port = await server.start()
    fetcher = TcpPageFetcher("127.0.0.1", port)
    try:
        keys = [key(1), key(2)]
        dests = [bytearray(PAGE) for _ in keys]
        result = await fetcher.fetch(NS, keys, dests, timeout_s=20)
        assert result.statuses == [FetchStatus.OK] * 2 and result.error is None
        assert bytes(dests[1]) == np.random.default_rng(keys[1][1]).integers(0, 256, PAGE, dtype=np.uint8).tobytes()
        assert len(source.threads) == 1 and source.threads[0] != threading.current_thread().name
    finally:
        await fetcher.close()
        await server.close()


def test_a_peer_closing_mid_page_is_a_transport_error(path: str) -> None:
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"x" * 1000)
        b.shutdown(socket.SHUT_WR)
        with pytest.raises(TransportError):
            recv_hashed(a, memoryview(bytearray(PAGE)), running_checksum(), Deadline(5))


def test_a_silent_peer_ends_a_receive_at_its_deadline(path: str) -> None:
    a, b = socket.socketpair()
    with a, b:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            recv_hashed(a, memoryview(bytearray(PAGE)), running_checksum(), Deadline(0.3))
        assert time.monotonic() - t0 < 1.5


def test_a_peer_that_does_not_read_ends_a_send_at_its_deadline(path: str) -> None:
    a, b = socket.socketpair()
    with a, b:
        data = np.zeros(16 << 20, np.uint8)  # more than both socket buffers hold
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            send_hashed(a, memoryview(data), running_checksum(), checksum(data), Deadline(0.3))
        assert time.monotonic() - t0 < 1.5


def test_a_send_that_does_not_match_sends_no_last_chunk(path: str) -> None:
    a, b = socket.socketpair()
    with a, b:
        data = np.random.default_rng(3).integers(0, 256, PAGE, dtype=np.uint8)
        got = bytearray()

        def read() -> None:
            while chunk := b.recv(1 << 20):
                got.extend(chunk)

        reader = threading.Thread(target=read)
        reader.start()
        assert not send_hashed(a, memoryview(data), running_checksum(), checksum(data) ^ 1, Deadline(5))
        a.shutdown(socket.SHUT_WR)
        reader.join(5)
        assert 0 < len(got) < PAGE and data.tobytes().startswith(bytes(got))


def test_a_socket_in_timeout_mode_is_waited_on_not_spun_on(path: str) -> None:
    """A socket with a Python timeout (settimeout, or a process-wide setdefaulttimeout that
    accept() hands on) has O_NONBLOCK set: a wait for the peer is a poll, not a busy loop
    of EAGAIN (a thread burning a core until the peer moves)."""
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5.0)
        page = bytes(range(256)) * (PAGE // 256)
        sender = threading.Timer(1.0, b.sendall, (page,))
        sender.start()
        t0 = time.thread_time()
        view = memoryview(bytearray(PAGE))
        recv_hashed(a, view, running_checksum(), Deadline(10))
        received_cpu = time.thread_time() - t0
        sender.join()
        assert bytes(view) == page
        data = np.zeros(16 << 20, np.uint8)  # more than both socket buffers hold: waits for the reader
        reader = threading.Timer(1.0, lambda: [b.recv_into(bytearray(1 << 20)) for _ in range(8)])
        reader.start()
        t0 = time.thread_time()
        with pytest.raises(TimeoutError):
            send_hashed(a, memoryview(data), running_checksum(), checksum(data), Deadline(2.0))
        sent_cpu = time.thread_time() - t0
        reader.join()
        assert received_cpu < 0.25 and sent_cpu < 0.25, (received_cpu, sent_cpu)


def test_a_deadline_without_end_bounds_nothing_and_breaks_nothing(path: str) -> None:
    """Deadline(math.inf) (a caller with no deadline of its own) waits as long as it takes:
    the seconds left converted to the kernel's timeval must not overflow (in C, a double
    out of time_t's range cast to it is undefined behaviour)."""
    a, b = socket.socketpair()
    with a, b:
        page = bytes(range(256)) * 64
        b.sendall(page)
        view = memoryview(bytearray(len(page)))
        recv_hashed(a, view, running_checksum(), Deadline(math.inf))
        assert bytes(view) == page
        assert send_hashed(a, memoryview(page), running_checksum(), checksum(page), Deadline(math.inf))
        assert b.recv(len(page), socket.MSG_WAITALL) == page


def test_an_empty_page_is_sent_only_when_it_matches_its_checksum(path: str) -> None:
    """No chunk to hash is still a page to check: an empty buffer whose expected checksum is
    not the empty one's is a mismatch, as any other page's would be."""
    a, b = socket.socketpair()
    with a, b:
        assert send_hashed(a, memoryview(b""), running_checksum(), checksum(b""), Deadline(5))
        assert not send_hashed(a, memoryview(b""), running_checksum(), checksum(b"") ^ 1, Deadline(5))
