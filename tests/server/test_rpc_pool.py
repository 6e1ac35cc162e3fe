"""The gRPC server's worker pool ends idle threads (issue 34, check e): a burst's threads do
not stay for the life of the process, each with its own malloc cache and stack.
concurrent.futures.ThreadPoolExecutor fails test_burst_threads_end (its threads never end)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from kvstore.server.rpc_pool import RetiringPool

IDLE_S = 0.2


def _pool_threads(prefix: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix + "_"))


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_burst_threads_end() -> None:
    pool = RetiringPool(8, idle_s=IDLE_S, name="burst")
    release = threading.Event()
    started = threading.Barrier(9)

    def block() -> int:
        started.wait(5)
        release.wait(5)
        return 1

    calls = [pool.submit(block) for _ in range(8)]
    started.wait(5)  # 8 calls at once: 8 threads
    assert _pool_threads("burst") == 8
    release.set()
    assert sum(c.result(5) for c in calls) == 8
    assert _wait_for(lambda: _pool_threads("burst") == 0), f"{_pool_threads('burst')} idle threads stayed"
    assert pool.submit(lambda: 7).result(5) == 7  # a pool whose threads ended starts one again
    pool.shutdown()
    assert _pool_threads("burst") == 0


def test_bounded_and_queued() -> None:
    pool = RetiringPool(3, idle_s=IDLE_S, name="bounded")
    release = threading.Event()
    running = []
    lock = threading.Lock()

    def block(i: int) -> int:
        with lock:
            running.append(i)
        release.wait(5)
        return i

    calls = [pool.submit(block, i) for i in range(10)]
    assert _wait_for(lambda: len(running) == 3)
    time.sleep(0.1)
    assert len(running) == 3 and _pool_threads("bounded") == 3  # the other 7 wait in the queue
    release.set()
    assert [c.result(5) for c in calls] == list(range(10))
    pool.shutdown()


def test_results_errors_and_shutdown() -> None:
    pool = RetiringPool(2, idle_s=IDLE_S, name="results")
    assert pool.submit(lambda a, b=0: a + b, 2, b=3).result(5) == 5
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    pool.shutdown(wait=True)
    assert _pool_threads("results") == 0
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)


def test_steady_calls_keep_their_threads() -> None:
    """Calls that come more often than idle_s find an idle thread: no thread churn."""
    pool = RetiringPool(4, idle_s=IDLE_S, name="steady")
    seen = set()
    for _ in range(20):
        seen.add(pool.submit(lambda: threading.current_thread().name).result(5))
        time.sleep(IDLE_S / 10)
    assert len(seen) == 1
    pool.shutdown()


def test_grpc_server_threads_end_after_a_burst() -> None:
    """A real grpc.server on the pool: a burst of concurrent calls starts threads, which end
    once the burst is over, and the server still answers."""
    pool = RetiringPool(16, idle_s=IDLE_S, name="grpcburst")
    gate = threading.Barrier(8)

    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        if request == b"burst":
            gate.wait(5)
        return b"ok:" + request

    handler = grpc.method_handlers_generic_handler("t.Burst", {"U": grpc.unary_unary_rpc_method_handler(unary)})
    server = grpc.server(pool, handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.Burst/U")
            with futures.ThreadPoolExecutor(8) as callers:
                answers = list(callers.map(lambda _: call(b"burst", timeout=10), range(8)))
            assert answers == [b"ok:burst"] * 8
            assert _pool_threads("grpcburst") >= 8
            assert _wait_for(lambda: _pool_threads("grpcburst") == 0), f"{_pool_threads('grpcburst')} threads stayed"
            assert call(b"again", timeout=10) == b"ok:again"
    finally:
        server.stop(None)
        pool.shutdown()
