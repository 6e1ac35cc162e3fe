"""A UCX fetch cancelled while it abandons a transfer (``UcxPageFetcher._abandon``, DESIGN §12.3):
it ends only once every receive it posted has reported its end, or raises DestinationsInUse.

Bug pinned here: ``_abandon`` waits for the posted receives after its abort; a cancel landing in
that wait (the caller cutting a fetch that hit its own deadline: ``run_on(to_end=True)`` cancels
it past its caller's time, and the abort's wait can take 2 s) ended the wait at once, and the fetch
ended cancelled with receives still posted: its caller gave the destinations back (a plain cancel,
no DestinationsInUse) while UCX could still write into them. And the receive the fetch was waiting
on when its deadline (or its caller) cancelled it was cancelled with it: ucxx cancels only the
wait, its request stays posted, and ``_abandon``, finding it done, never waited for its end.

A real page server in a child process over UCX on loopback, frozen (SIGSTOP) as the first page's
receive is posted, so the receives stay posted until the fetch is abandoned: at its deadline, or
cut by its caller (a first cancel). Stand-ins at the endpoint: each page receive's end is reported
only once the test lets it (UCX on loopback reports a cancelled receive within the abort call; with
a progress thread or a real NIC it comes later, which is what the wait is for), and the fetch's
task is cancelled as it drops the connection to abandon the fetch: that cancel lands in the abort's
wait."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from typing import Any

import pytest
from fetch_contract import NS, Arena, key
from test_transport_ucx import TCP, arena, servers  # noqa: F401  # the fixtures

from kvstore.cluster.cluster_errors import DestinationsInUse
from kvstore.cluster.transport_ucx import UcxPageFetcher

PAGES, PAGE_BYTES = 64, 1 << 20
DEADLINE_S = 3.0  # the fetch's own, where it is abandoned at its deadline (the connection is up by then)
WAIT_S = 30.0  # only a broken fetch waits this long


class _Held:
    """A UCX endpoint whose page receives, once the fetcher is ``armed``, are noted as they are posted
    and report their end only once ``released``; the sender is frozen as the first is posted."""

    def __init__(self, ep: Any, fetcher: CancelledAtItsAbort) -> None:
        self._ep, self._fetcher = ep, fetcher

    def recv(self, buffer: Any) -> Any:
        fetcher = self._fetcher
        if not fetcher.armed or len(buffer) != PAGE_BYTES:  # a frame's
            return self._ep.recv(buffer)
        if not fetcher.receives:
            os.kill(fetcher.sender, signal.SIGSTOP)
            fetcher.posted.set()
        fetcher.receives.append(receive := asyncio.ensure_future(self._reported_late(self._ep.recv(buffer))))
        return receive

    async def _reported_late(self, receive: Any) -> Any:
        """A cancel (the fetch's deadline, while it awaits this receive) ends it at once, as it ends UCX's
        (whose request stays posted: ucxx cancels only the wait)."""
        try:
            result = await receive
        except asyncio.CancelledError:
            self._fetcher.num_cut += 1
            raise
        except BaseException:  # aborted
            await self._fetcher.released.wait()
            raise
        await self._fetcher.released.wait()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ep, name)


class CancelledAtItsAbort(UcxPageFetcher):
    """The UCX fetcher on a ``_Held`` endpoint; once ``armed``, its task cancelled as it drops the
    connection to abandon a fetch."""

    def __init__(self, sender: int, *args: Any) -> None:
        super().__init__(*args)
        self.sender = sender
        self.armed = False
        self.receives: list[asyncio.Future[Any]] = []
        self.num_cut = 0  # receives whose wait was cancelled: nothing waits for their request's end any more
        self.posted, self.dropped, self.released = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def _connect(self) -> None:
        await super()._connect()
        if not isinstance(self._ep, _Held):
            self._ep = _Held(self._ep, self)

    def _drop(self) -> None:
        if self.armed and self._ep is not None and not self.dropped.is_set():
            self.dropped.set()
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # lands at the abort wait's first await
        super()._drop()


@pytest.mark.parametrize("abandoned", ["at-its-deadline", "cut-by-its-caller"])
async def test_a_cancel_inside_the_abort_wait_ends_the_fetch_only_after_its_receives(servers, arena: Arena,  # noqa: F811
                                                                                     abandoned: str) -> None:
    child = await servers(PAGE_BYTES)
    fetcher = CancelledAtItsAbort(child.proc.pid, "127.0.0.1", child.port, TCP)
    warm = await fetcher.fetch(NS, [key(0)], [bytearray(PAGE_BYTES)], timeout_s=WAIT_S)  # connected: the deadline is the answer's
    assert warm.error is None, warm.error
    fetcher.armed = True
    posted_at_end: list[int] = []

    async def fetch() -> Any:
        try:
            return await fetcher.fetch(NS, [key(i) for i in range(PAGES)], arena.slots(PAGE_BYTES, PAGES),
                                       timeout_s=DEADLINE_S if abandoned == "at-its-deadline" else WAIT_S)
        finally:  # as the fetch returns or raises, its caller takes the destinations back
            posted_at_end.append(sum(not r.done() for r in fetcher.receives))

    task = asyncio.ensure_future(fetch())
    try:
        await asyncio.wait_for(fetcher.posted.wait(), WAIT_S)
        if abandoned == "cut-by-its-caller":
            task.cancel()
        await asyncio.wait_for(fetcher.dropped.wait(), WAIT_S)
        await asyncio.wait({task}, timeout=0.2)  # the old fetch ended here, its receives still posted
    finally:
        fetcher.released.set()
    with pytest.raises((asyncio.CancelledError, DestinationsInUse)) as ended:
        await asyncio.wait_for(task, WAIT_S)
    kept_back = ended.type is DestinationsInUse
    del ended, task  # their tracebacks hold the fetch's frames, and the arena's slots in them, until the arena closes
    fetcher.armed = False
    await fetcher.close()
    fetcher.receives.clear()
    gc.collect()  # the receives' ended frames hold the arena's slots too
    assert fetcher.num_cut == 0, "a receive's wait was cancelled: the abort's wait did not wait for its request"
    if not kept_back:  # its caller may reuse the destinations now
        assert posted_at_end == [0], "the fetch ended while receives it posted could still write into its destinations"
