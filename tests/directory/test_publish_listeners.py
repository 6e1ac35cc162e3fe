"""A publish tells the event log's listeners once, on the publishing thread, after its pages are
readable (a handoff's push acts on it at once: DESIGN §12.7), and wakes a waiter once for all its
pages, not once per page."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from kvstore.directory import Directory, EventKind

NS = b"n" * 16


def test_a_listener_sees_every_page_of_the_publish_that_called_it(tmp_path: Path) -> None:
    directory = Directory(tmp_path, "a")
    seen: list[tuple[bytes, frozenset[str], int]] = []
    keys = [bytes([i]) * 16 for i in range(8)]
    directory.events.listen(lambda ns, nodes: seen.append((ns, nodes, directory.prefix_length(ns, keys, "a"))))
    directory.publish(NS, [(k, "a", "host", 4096) for k in keys[:3]])
    directory.publish(NS, [(k, "b", "host", 4096) for k in keys[3:]])
    assert seen == [(NS, frozenset({"a"}), 3), (NS, frozenset({"b"}), 3)]


def test_an_unlistened_listener_is_not_called(tmp_path: Path) -> None:
    directory = Directory(tmp_path, "a")
    calls: list[bytes] = []
    listener = lambda ns, nodes: calls.append(ns)
    directory.events.listen(listener)
    directory.events.unlisten(listener)
    directory.publish(NS, [(b"k" * 16, "a", "host", 4096)])
    assert calls == []


def test_a_waiter_wakes_once_to_the_whole_publish(tmp_path: Path) -> None:
    """A waiter asleep in ``wait_since`` before a 64-page publish first reads all 64 pages: they
    are logged without a wake, then one wake. Woken per page (before), it took the log's lock
    between two pages and read a part, the interpreter switching threads every microsecond."""
    directory = Directory(tmp_path, "a")
    asleep = threading.Event()
    directory.events._cond = _Announcing(asleep)  # type: ignore[attr-defined]
    first = directory.events.last_seq + 1
    batches: list[int] = []
    waiter = threading.Thread(target=lambda: batches.append(len(directory.events.wait_since(first, 10.0))))
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        waiter.start()
        assert asleep.wait(10.0)  # the publish's first append takes the lock the waiter's wait gives up
        directory.publish(NS, [(bytes([i]) * 16, "a", "host", 4096) for i in range(64)])
        waiter.join(10.0)
    finally:
        sys.setswitchinterval(before)
    assert batches == [64]
    assert all(ev.kind is EventKind.STORED for ev in directory.events.since(first))


class _Announcing(threading.Condition):
    """A condition that says when a thread is about to wait on it (it holds the lock until then)."""

    def __init__(self, asleep: threading.Event) -> None:
        super().__init__()
        self._asleep = asleep

    def wait(self, timeout: float | None = None) -> bool:
        self._asleep.set()
        return super().wait(timeout)


def test_a_failing_listener_does_not_fail_the_publish(tmp_path: Path) -> None:
    """The pages are published when the listeners are told: a listener that raises is logged, and
    the publish (a client's commit) still answers, the listeners after it told too."""
    directory = Directory(tmp_path, "a")
    told: list[bytes] = []

    def broken(ns: bytes, nodes: frozenset[str]) -> None:
        raise RuntimeError("a listener's bug")

    directory.events.listen(broken)
    directory.events.listen(lambda ns, nodes: told.append(ns))
    assert len(directory.publish(NS, [(b"k" * 16, "a", "host", 4096)])) == 1
    assert told == [NS] and directory.prefix_length(NS, [b"k" * 16], "a") == 1
