"""The gRPC server's worker threads: up to ``max_workers``, each ending after ``idle_s``
without work.

More: kvstore/server/README.md (### rpc_pool.py).
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

IDLE_S = 10.0  # a burst's extra threads end this long after it; a new one costs ~0.1 ms to start

_Item = tuple[futures.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class RetiringPool(futures.Executor):
    """An Executor for ``grpc.server``: ``submit`` runs at once on an idle thread or a new one
    (up to ``max_workers``), else waits in the queue, as ThreadPoolExecutor's does.

    The queue and the count of threads waiting for work change only under one lock, so a submit
    knows exactly whether the waiting threads cover the queued tasks; a count of idle threads kept
    apart from the queue (ThreadPoolExecutor's semaphore) counts one too many after a thread ran a
    task queued while all were busy, and once threads retire that phantom left a task waiting
    behind long calls in a pool below its limit."""

    def __init__(self, max_workers: int, idle_s: float = IDLE_S, name: str = "rpc") -> None:
        if max_workers <= 0:
            raise ValueError("max_workers must be > 0")
        self._max = max_workers
        self._idle_s = idle_s
        self._name = name
        self._cond = threading.Condition()
        self._items: collections.deque[_Item] = collections.deque()
        self._waiting = 0  # threads inside wait(): each takes a queued task when it wakes
        self._threads: set[threading.Thread] = set()
        self._ids = itertools.count()
        self._shutdown = False

    @property
    def num_threads(self) -> int:
        with self._cond:
            return len(self._threads)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        future: futures.Future[Any] = futures.Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._items.append((future, fn, args, kwargs))
            if self._waiting:
                self._cond.notify()
            if self._waiting < len(self._items) and len(self._threads) < self._max:
                thread = threading.Thread(target=self._work, name=f"{self._name}_{next(self._ids)}", daemon=True)
                self._threads.add(thread)
                thread.start()
        return future

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._items:
                    if self._shutdown:
                        self._threads.discard(me)
                        return
                    self._waiting += 1
                    woken = self._cond.wait(self._idle_s)
                    self._waiting -= 1
                    if not woken and not self._items:  # idle for idle_s: it ends (a task queued meanwhile is taken)
                        self._threads.discard(me)
                        return
                future, fn, args, kwargs = self._items.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 -- handed to the caller, as ThreadPoolExecutor does
                    future.set_exception(exc)
            del future, fn, args, kwargs

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                while self._items:
                    self._items.popleft()[0].cancel()
            threads = list(self._threads)
            self._cond.notify_all()  # queued tasks still run (as ThreadPoolExecutor's), then the threads end
        if wait:
            for thread in threads:
                thread.join()
