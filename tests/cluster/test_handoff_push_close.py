"""The prefill node's handoff pushes (DESIGN §12.7) at close: no Push starts once ``close`` began.
Its pushes in flight are cancelled; each one's end kicked the handoff again (pages stored while
they were in flight), and a namespace handed to the loop by a publish before the close was kicked
too: either started a Push after close, a task nothing cancels or awaits (sent while the node
leaves, then destroyed pending with the loop)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from kvstore.directory import Directory
from kvstore.server.cluster.handoff_push import HandoffPushes

NS = b"n" * 16
KEYS = [bytes([i + 1]) * 16 for i in range(3)]


def _pushes(tmp_path: Path) -> tuple[Directory, HandoffPushes, list[list[bytes]]]:
    directory = Directory(tmp_path, "a")
    remote = SimpleNamespace(core=SimpleNamespace(directory=directory),
                             local_prefix=lambda ns, keys: directory.prefix_length(ns, keys, "a"))
    pushes = HandoffPushes("a", remote, SimpleNamespace(get=lambda node: None), 1.0)  # type: ignore[arg-type]
    sent: list[list[bytes]] = []

    async def send(out: object, keys: list[bytes], complete: bool, timeout_s: float) -> int:
        sent.append(list(keys))
        await asyncio.Event().wait()  # in flight until cancelled
        return len(keys)

    pushes._send = send  # type: ignore[method-assign]
    pushes.start()
    return directory, pushes, sent


async def _until(check: object, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.001)


def _others() -> set[asyncio.Task[object]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}


async def test_the_end_of_a_cancelled_push_starts_no_push_after_close(tmp_path: Path) -> None:
    directory, pushes, sent = _pushes(tmp_path)
    await pushes.open("t", NS, b"h" * 16, "b", 30_000, KEYS, lambda: True)
    directory.publish(NS, [(KEYS[0], "a", "host", 4096)])
    await _until(lambda: len(sent) == 2)  # the announce and page 0's push: both calls in flight
    directory.publish(NS, [(KEYS[1], "a", "host", 4096)])  # waits for a call to end
    await _until(lambda: not pushes._pending)
    await pushes.close()
    assert sent == [[], [KEYS[0]]] and not _others()


async def test_a_publish_handed_on_before_close_starts_no_push_after_it(tmp_path: Path) -> None:
    directory, pushes, sent = _pushes(tmp_path)
    await pushes.open("t", NS, b"h" * 16, "b", 30_000, KEYS, lambda: True)
    await _until(lambda: len(sent) == 1)  # the announce
    closing = asyncio.ensure_future(pushes.close())  # its first step is queued first
    directory.publish(NS, [(KEYS[0], "a", "host", 4096)])  # on this thread, before it: the kick queued after it
    await closing
    assert sent == [[]] and not _others()
