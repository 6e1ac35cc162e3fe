"""The gRPC server's worker pool ends idle threads (the chaos run's RSS check): a burst's threads do
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
    pool = RetiringPool(4, idle_s=5.0, name="steady")  # far past a call's gap, however slow the host
    seen = set()
    for _ in range(20):
        seen.add(pool.submit(lambda: threading.current_thread().name).result(5))
        assert _wait_for(lambda: pool._waiting == 1)  # the thread is back waiting (not yet: a second would start)
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


def test_a_task_queued_while_the_pool_was_full_leaves_no_phantom_idle_thread() -> None:
    """A thread that ran a task queued while every thread was busy counted itself idle for it,
    and that extra count outlived it once it retired: the next task, in a pool below its limit,
    took the count instead of a thread and waited behind a long call (a stream) for ever."""
    pool = RetiringPool(2, idle_s=IDLE_S, name="phantom")
    first, long_call = threading.Event(), threading.Event()
    try:
        a = pool.submit(first.wait, 10)
        b = pool.submit(long_call.wait, 30)  # the pool is full
        queued = pool.submit(lambda: 1)  # waits for a thread
        first.set()
        assert a.result(5) and queued.result(5) == 1
        assert _wait_for(lambda: pool.num_threads == 1), "the idle thread did not retire"
        assert pool.submit(lambda: 2).result(5) == 2, "a task waited behind the long call with the pool below its limit"
    finally:
        long_call.set()
        b.result(30)
        pool.shutdown()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_long_and_short_calls_never_leave_a_short_one_waiting_below_the_limit(seed: int) -> None:
    """Random long calls (held until released), short ones, releases and idle pauses past idle_s:
    while fewer than max_workers long calls run, a short call runs at once (the model: a free thread
    exists or can be started), and the pool never holds more threads than its limit."""
    import random

    rng = random.Random(seed)
    pool = RetiringPool(3, idle_s=0.05, name=f"random{seed}")
    held: list[tuple[threading.Event, futures.Future[bool]]] = []
    queued: list[futures.Future[int]] = []
    try:
        for _ in range(300):
            op = rng.random()
            if op < 0.3 and len(held) < 3:
                gate = threading.Event()
                held.append((gate, pool.submit(gate.wait, 30)))
            elif op < 0.55 and held:
                gate, call = held.pop(rng.randrange(len(held)))
                gate.set()
                assert call.result(5)
            elif op < 0.65:
                time.sleep(rng.choice([0.01, 0.06, 0.12]))  # some threads retire
            elif len(held) < 3:
                assert pool.submit(lambda: 7).result(2) == 7, f"a short call waited with {len(held)} long ones running"
            else:
                queued.append(pool.submit(lambda: 8))  # the pool is full: it waits for a thread
            assert pool.num_threads <= 3
            if len(held) < 3:
                assert all(q.result(2) == 8 for q in queued), "a call queued while the pool was full never ran"
                queued.clear()
    finally:
        for gate, call in held:
            gate.set()
            call.result(5)
        pool.shutdown()
