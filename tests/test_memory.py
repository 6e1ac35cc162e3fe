"""The C heap figures the server exports and the chaos run's memory check (e) relies on:
freed buffers kept by malloc count as free, not in use, and (e) tells a leak from that."""

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


def _steady(anon_mib: int, free_mib: int, fds: int = 40) -> dict[str, int]:
    return {"anon": anon_mib * MiB, "heap_free": free_mib * MiB, "fds": fds}


def test_memory_check_tells_a_leak_from_retained_buffers() -> None:
    """(e): anon grown by buffers malloc keeps for reuse is no violation; anon grown by held
    memory is; so are descriptors."""
    assert resource_violations([_steady(47, 2), _steady(60, 14)]) == []
    leak = resource_violations([_steady(47, 2), _steady(60, 3)])
    assert [v["check"] for v in leak] == ["e"] and "held" in leak[0]["what"]
    assert [v["what"].split()[2] for v in resource_violations([_steady(47, 2, 40), _steady(47, 2, 49)])] == ["fds"]
