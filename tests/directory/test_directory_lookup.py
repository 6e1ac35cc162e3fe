"""The directory answers a prefix as runs of pages held in one place, in order."""

from __future__ import annotations

import threading

from kvstore.directory import Directory
from kvstore.types import LocationRun

NS = b"n" * 16


def _keys(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in range(start, start + n)]


def test_lookup_answers_runs_of_the_best_locations(tmp_path) -> None:
    d = Directory(tmp_path, "me")
    keys = _keys(512)
    d.publish(NS, [(k, "me", "host", 4096) for k in keys[:300]])
    d.publish(NS, [(k, "me", "ssd", 4096) for k in keys[200:400]])  # 200..299 are in both: host is best
    d.publish(NS, [(k, "other", "remote", 4096) for k in keys[400:]])
    assert d.lookup(NS, keys) == [LocationRun("me", "host", 300, 4096), LocationRun("me", "ssd", 100, 4096),
                                  LocationRun("other", "remote", 112, 4096)]
    assert d.prefix_length(NS, keys) == 512
    d.remove(keys[250])
    assert d.lookup(NS, keys) == [LocationRun("me", "host", 250, 4096)], "a gap ends the prefix"
    assert d.prefix_length(NS, keys) == 250
    assert d.lookup(b"x" * 16, keys) == [] and d.prefix_length(b"x" * 16, keys) == 0, "another namespace finds nothing"
    d.close()


def test_lookups_run_beside_changes(tmp_path) -> None:
    """Lookups from several threads while another thread publishes and removes: every
    answer is a well-formed contiguous prefix (runs add up, no page counted twice)."""
    d = Directory(tmp_path, "me")
    keys = _keys(256)
    stop = threading.Event()
    bad: list[object] = []

    def churn() -> None:
        while not stop.is_set():
            d.publish(NS, [(k, "me", "host", 4096) for k in keys])
            for k in keys[128:]:
                d.remove(k)

    def read() -> None:
        for _ in range(300):
            runs = d.lookup(NS, keys)
            total = sum(r.num_pages for r in runs)
            if not 0 <= total <= 256 or any(r.num_pages <= 0 for r in runs):
                bad.append(runs)

    writer = threading.Thread(target=churn)
    readers = [threading.Thread(target=read) for _ in range(3)]
    writer.start()
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    stop.set()
    writer.join()
    assert not bad
    d.close()


def test_lookup_follows_every_change_of_a_page(tmp_path) -> None:
    """Lookups keep each page's best location between changes; every change (publish of a
    better or a worse copy, remove of one, a restart's restore) shows in the next lookup."""
    d = Directory(tmp_path, "me")
    [key] = _keys(1)
    d.publish(NS, [(key, "me", "ssd", 4096)])
    assert d.lookup(NS, [key]) == [LocationRun("me", "ssd", 1, 4096)]
    d.publish(NS, [(key, "me", "host", 4096)])
    assert d.lookup(NS, [key]) == [LocationRun("me", "host", 1, 4096)]
    d.publish(NS, [(key, "other", "remote", 4096)])
    assert d.lookup(NS, [key]) == [LocationRun("me", "host", 1, 4096)]
    d.remove(key, "me", "host")
    assert d.lookup(NS, [key]) == [LocationRun("me", "ssd", 1, 4096)]
    d.remove(key, "me", "ssd")
    assert d.lookup(NS, [key]) == [LocationRun("other", "remote", 1, 4096)]
    d.restore_local([(key, NS, "host", 8192)])
    assert d.lookup(NS, [key]) == [LocationRun("me", "host", 1, 8192)]
    d.remove(key)
    assert d.lookup(NS, [key]) == []
    d.close()
