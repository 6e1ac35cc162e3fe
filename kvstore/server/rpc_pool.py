"""The gRPC server's worker threads: up to ``max_workers``, each ending after ``idle_s``
without work.

``concurrent.futures.ThreadPoolExecutor`` starts a thread whenever no idle one is free and
never ends one, so the pool keeps the most threads a burst ever needed (``--workers`` plus
``--max-streams``: 48 by default) for the life of the process. Each of them keeps its own
glibc tcache of freed chunks (counted as in use, reusable by no other thread) and its stack:
in the chaos run (issue 34, check e) the steady node's pool grew by a thread every few
histories and its C heap in use with it; with the tcache turned off the heap stayed flat
while the threads still grew. Here a thread idle for ``idle_s`` ends, which hands its tcache
back to the arena for every other thread to reuse, so what stays is what recent load needs.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

IDLE_S = 10.0  # a burst's extra threads end this long after it; a new one costs ~0.1 ms to start

_Item = tuple[futures.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class RetiringPool(futures.Executor):
    """An Executor for ``grpc.server``: ``submit`` runs at once on an idle thread or a new one
    (up to ``max_workers``), else waits in the queue, as ThreadPoolExecutor's does."""

    def __init__(self, max_workers: int, idle_s: float = IDLE_S, name: str = "rpc") -> None:
        if max_workers <= 0:
            raise ValueError("max_workers must be > 0")
        self._max = max_workers
        self._idle_s = idle_s
        self._name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        # One permit per idle thread no submit has counted on yet: a submit takes one instead
        # of starting a thread, and a thread ends only if it can take its own back.
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._ids = itertools.count()
        self._shutdown = False

    @property
    def num_threads(self) -> int:
        with self._lock:
            return len(self._threads)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        future: futures.Future[Any] = futures.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.put((future, fn, args, kwargs))
            if self._idle.acquire(blocking=False) or len(self._threads) >= self._max:
                return future
            thread = threading.Thread(target=self._work, name=f"{self._name}_{next(self._ids)}", daemon=True)
            self._threads.add(thread)
        thread.start()
        return future

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            try:
                item = self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._idle.acquire(blocking=False):  # no submit counts on this thread: it ends
                        self._threads.discard(me)
                        return
                continue  # a submit took the permit: its item is in the queue for some idle thread
            if item is None:  # shutdown
                with self._lock:
                    self._threads.discard(me)
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 -- handed to the caller, as ThreadPoolExecutor does
                    future.set_exception(exc)
            del item, future, fn, args, kwargs
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._queue.put(None)
        if wait:
            for thread in threads:
                thread.join()
