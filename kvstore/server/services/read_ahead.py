"""ReadPages' checked messages built one page ahead: while gRPC sends one page's messages, a worker
thread copies and checks the next one into its message (the native copy releases the GIL). A node's
fill, sent unhashed (DESIGN §4), is built on the sending thread instead (``map_now``): its build is one
copy, and the hop to the worker and back cost more CPU than the overlap saved (services/README.md).

Measured before (timeline of a 64-page remote get, node c reading node a over ReadPages):
the sender built each 2 MiB message (copy + checksum, ~0.6 ms) only after the previous one
had been sent, in series with the send. Every page built is of a leased slot, so nothing
may still be reading one when the stream ends: ``built_ahead`` waits for the page in flight
before it returns, whatever ends it (the caller's release of the lease follows)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

P = TypeVar("P")
R = TypeVar("R")


def built_ahead(pages: Iterable[P], build: Callable[[P], R], pool: concurrent.futures.Executor) -> Iterator[R]:
    """``build(page)`` of each page in order, the next one built on ``pool`` while the caller
    uses the current one. An exception of ``build`` reaches the caller at its page."""
    it = iter(pages)
    pending: concurrent.futures.Future[R] | None = None
    try:
        page = next(it, None)
        pending = pool.submit(build, page) if page is not None else None
        while pending is not None:
            current = pending.result()
            page = next(it, None)
            pending = pool.submit(build, page) if page is not None else None
            yield current
    finally:
        if pending is not None and not pending.cancel():
            concurrent.futures.wait([pending])  # it reads a leased slot: done before the lease goes


def map_now(pages: Iterable[P], build: Callable[[P], R]) -> Iterator[R]:
    """``build(page)`` of each page in order, on the caller's thread when it asks for the page
    (``built_ahead`` without the worker: nothing is left in flight when it is closed)."""
    for page in pages:
        yield build(page)
