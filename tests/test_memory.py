"""The C heap figures the server exports (kvstore_heap_bytes) and the chaos run's memory check
(e): freed buffers malloc keeps count as free, not in use."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

from kvstore.bench.chaos.runner import resource_violations

MiB = 1 << 20


def test_freed_buffers_count_as_free_not_in_use() -> None:
    """After tune_malloc, 64 MiB of freed 1 MiB buffers stay on the heap (on purpose), and
    heap_bytes() says so: in use back where it was, free up by about as much."""
    script = """
from kvstore.memory import heap_bytes, tune_malloc
assert tune_malloc()
before = heap_bytes()
buffers = [bytearray(1 << 20) for _ in range(64)]
held = heap_bytes()
del buffers
after = heap_bytes()
print(before["in_use"], held["in_use"], after["in_use"], before["free"], after["free"])
"""
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=60).stdout
    in_before, in_held, in_after, free_before, free_after = map(int, out.split())
    assert in_held - in_before >= 64 * MiB
    assert abs(in_after - in_before) < 4 * MiB
    assert free_after - free_before >= 60 * MiB


def test_server_exports_its_heap(server) -> None:
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'kvstore_heap_bytes{state="in_use"}' in metrics and 'kvstore_heap_bytes{state="free"}' in metrics


def _steady(anon_mib: int, in_use_mib: int, fds: int = 40) -> dict[str, int]:
    return {"anon": anon_mib * MiB, "heap_in_use": in_use_mib * MiB, "heap_free": 100 * MiB, "fds": fds}


def test_memory_check_bounds_anon_and_names_the_heap_in_use() -> None:
    """(e) bounds RssAnon (10 % or 8 MiB) and descriptors. malloc's free figure is no use to it: it
    counts untouched space (the 64 MiB top pad) and exceeds RssAnon itself on a real node."""
    assert resource_violations([_steady(47, 28), _steady(54, 29)]) == []
    grown = resource_violations([_steady(47, 28), _steady(58, 32)])
    assert [v["check"] for v in grown] == ["e"] and "C heap in use 29360128 -> 33554432" in grown[0]["what"]
    assert [v["what"].split()[2] for v in resource_violations([_steady(47, 28, 40), _steady(47, 28, 49)])] == ["fds"]
