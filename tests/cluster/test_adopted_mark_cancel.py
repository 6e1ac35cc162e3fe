"""The background mark "adopted here" (DESIGN §12.8: etcd told, after Adopt, until it answers) is a
task of the cluster runtime, cancelled and gathered when the node leaves. Its etcd call was bounded by
Python 3.11's ``asyncio.wait_for``, which, when the cancel arrives as the call ends, returns (or raises)
the call's outcome and swallows the cancel: an etcd error at that moment sent the loop into its
retries, and the leave waited on it (up to its 15 s) while etcd was gone. etcd is faked: each call
waits on a future the test settles."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvstore.cluster.cluster_errors import CoordinatorUnavailable
from kvstore.server.cluster.migrations import SessionMoves

NSID = b"\x01" * 16


class _Etcd:
    """``adopt`` waits until the test settles its answer (``answers[i]`` for the i-th call)."""

    def __init__(self) -> None:
        self.answers: list[asyncio.Future[None]] = []
        self.called = asyncio.Event()

    async def adopt(self, namespace_id: bytes, session_id: str, version: int, node: str) -> None:
        answer = asyncio.get_running_loop().create_future()
        self.answers.append(answer)
        self.called.set()
        await answer

    async def next_call(self) -> asyncio.Future[None]:
        await self.called.wait()
        self.called.clear()
        return self.answers[-1]


def _moves(etcd: _Etcd, timeout_s: float | None = None) -> SessionMoves:
    cluster = SimpleNamespace(node="b", cluster=SimpleNamespace(rpc_timeout_s=1.0))
    moves = SessionMoves(cluster, None, None)  # type: ignore[arg-type]  # owners and log: not used by the mark
    moves._etcd = etcd  # type: ignore[assignment]
    if timeout_s is not None:
        moves._timeout_s = lambda: timeout_s  # type: ignore[method-assign]
    return moves


async def _ended(task: asyncio.Task[None], within_s: float) -> bool:
    done, _ = await asyncio.wait({task}, timeout=within_s)
    return task in done


async def test_a_leave_that_cancels_the_mark_as_etcd_fails_it_ends_the_mark() -> None:
    etcd = _Etcd()
    task = asyncio.create_task(_moves(etcd)._mark_adopted(NSID, "s", 1))
    try:
        answer = await etcd.next_call()  # the mark waits on etcd's answer
        answer.set_exception(CoordinatorUnavailable("etcd closed the channel"))  # etcd fails it ...
        task.cancel()  # ... in the same turn of the loop as the leave cancels the runtime's tasks
        assert await _ended(task, 1.0), f"the cancelled mark went on: {len(etcd.answers)} etcd calls"
        assert task.cancelled()
        assert len(etcd.answers) == 1, "the cancelled mark asked etcd again"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_mark_etcd_does_not_answer_in_time_is_cut_and_tried_again() -> None:
    """The deadline keeps its meaning: past it the call is cancelled and tried again, until etcd answers."""
    etcd = _Etcd()
    task = asyncio.create_task(_moves(etcd, timeout_s=0.05)._mark_adopted(NSID, "s", 1))
    try:
        first = await etcd.next_call()  # never answered: cut at its deadline
        async with asyncio.timeout(2.0):
            second = await etcd.next_call()  # after the 0.1 s pause between tries
        assert first.cancelled()
        second.set_result(None)
        assert await _ended(task, 1.0)
        assert task.result() is None and len(etcd.answers) == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
