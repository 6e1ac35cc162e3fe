"""Calls from a gRPC worker thread into the cluster loop, cut at the caller's time.

A plain call is cancelled and returns at once. A fetch's call (``to_end``) returns only once the
cancelled coroutine has ended: a batch it was committing on a worker thread is stored or not by
then. Why: its caller settles the namespace's binding on what is held after the fetch (a first
write binds it only if it stored something, tenancy/owners.py), and pages committed after that
settle sat in an unbound namespace, unreadable by their tenant (DESIGN §11, §12.8).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
_POLL_S = 0.1  # how often a cut call's wait checks that the loop still runs (a stopped loop ends no task)


def run_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], timeout_s: float, to_end: bool = False) -> T:
    """Runs ``coro`` on ``loop`` from another thread. Past ``timeout_s`` it is cancelled and
    TimeoutError raised: at once, or (``to_end``) once it has ended, its clean-up included, or the
    loop stopped (its cause: what the coroutine raised as it ended, if anything but its cancel).
    concurrent.futures.CancelledError: the loop cancelled it (the node leaving)."""
    if not to_end:
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise
    ended: concurrent.futures.Future[T] = concurrent.futures.Future()
    tasks: list[asyncio.Task[T]] = []

    def start() -> None:
        tasks.append(task := loop.create_task(coro))
        task.add_done_callback(lambda done: _pass_on(done, ended))

    try:
        loop.call_soon_threadsafe(start)
    except RuntimeError:  # the loop is closed
        coro.close()
        raise
    try:
        return ended.result(timeout_s)
    except TimeoutError:
        pass
    try:
        loop.call_soon_threadsafe(lambda: tasks[0].cancel())  # after start: the loop runs them in order
    except RuntimeError:
        raise TimeoutError from None
    while not ended.done() and loop.is_running():
        concurrent.futures.wait([ended], _POLL_S)
    # from what the cut coroutine raised as it ended (DestinationsInUse: its buffers may still be written into)
    raise TimeoutError from (ended.exception(0) if ended.done() and not ended.cancelled() else None)


def _pass_on(task: asyncio.Task[T], ended: concurrent.futures.Future[T]) -> None:
    if task.cancelled():
        ended.cancel()
    elif (exc := task.exception()) is not None:
        ended.set_exception(exc)
    else:
        ended.set_result(task.result())
