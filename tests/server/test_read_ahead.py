"""ReadPages builds each page's messages one page ahead (kvstore/server/services/read_ahead.py):
the pages come out in order, a build's error reaches the reader at its page, and a stream
ended early never leaves a build reading a slot after it returns (the lease is released
right after). The close test was seen failing with the wait in built_ahead's finally removed."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import pytest

from kvstore.server.services.read_ahead import built_ahead


def test_in_order_and_built_once_each() -> None:
    calls: list[int] = []
    with ThreadPoolExecutor(2) as pool:
        out = list(built_ahead(range(20), lambda p: calls.append(p) or p * 10, pool))
    assert out == [p * 10 for p in range(20)] and sorted(calls) == list(range(20))


def test_a_failed_build_reaches_the_reader_at_its_page() -> None:
    def build(p: int) -> int:
        if p == 3:
            raise ValueError("page 3")
        return p

    got: list[int] = []
    with ThreadPoolExecutor(2) as pool, pytest.raises(ValueError, match="page 3"):
        for x in built_ahead(range(6), build, pool):
            got.append(x)  # noqa: PERF402 - the pages before the failing one, one by one
    assert got == [0, 1, 2]


def test_closed_early_waits_for_the_build_in_flight() -> None:
    """Closing while the next page is being built returns only after that build ended: the
    caller releases the pages' lease right after, and no build may read a slot then."""
    started, release = threading.Event(), threading.Event()
    running = threading.Event()

    def build(p: int) -> int:
        if p == 1:
            running.set()
            started.set()
            release.wait(5)
            running.clear()
        return p

    with ThreadPoolExecutor(2) as pool:
        gen = built_ahead(range(3), build, pool)
        with closing(gen):
            assert next(gen) == 0  # page 1 is now being built ahead
            assert started.wait(5)
            threading.Timer(0.2, release.set).start()
        assert not running.is_set(), "close() returned while page 1's build still read its slot (the lease goes next)"


def test_a_stopped_server_leaves_no_read_ahead_thread(server_factory) -> None:
    """The read-ahead workers are the server's: stop() ends them. Before, every server that
    had served a ReadPages left its workers running in the process after stop()."""
    import asyncio

    import grpc
    from test_streams import NS, _store_pages

    from kvstore._proto import data_pb2, data_pb2_grpc

    server = server_factory()
    keys = asyncio.run(_store_pages(server.address, 4))
    with grpc.insecure_channel(server.address) as channel:
        stub = data_pb2_grpc.DataStub(channel)
        assert len(list(stub.ReadPages(data_pb2.ReadPagesRequest(namespace_id=NS, keys=keys)))) >= 4
    before = {t for t in threading.enumerate() if t.name.startswith("read-ahead")}
    assert before, "ReadPages ran on the read-ahead workers"
    server.stop(grace_s=1)
    assert not [t for t in before if t.is_alive()], "read-ahead workers outlived their server"
