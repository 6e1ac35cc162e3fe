"""The C heap figures the server exports (kvstore_heap_bytes) and the chaos run's memory check
(e): freed buffers malloc keeps count as free, not in use."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import urllib.request

import pytest
from support.servers import ServerProcess

from kvstore.bench.chaos.runner import resource_violations
from kvstore.memory import TCACHE_OFF, tcache_env

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


def test_the_tcache_tunable_joins_the_operators_own() -> None:
    if platform.libc_ver()[0] != "glibc":
        assert tcache_env({}) is None  # nothing to turn off
        return
    assert tcache_env({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": TCACHE_OFF}
    joined = tcache_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert joined is not None and joined["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TCACHE_OFF}"
    assert tcache_env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=3"}) is None, "the operator's own count stays"
    assert tcache_env({"GLIBC_TUNABLES": TCACHE_OFF}) is None, "once re-executed, not again"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's tunable: elsewhere the server starts as it is")
@pytest.mark.parametrize("flags", [(), ("--malloc-tcache", "on")])
def test_the_server_runs_with_the_tcache_off_in_the_same_process(tmp_path, flags: tuple[str, ...]) -> None:
    """kvstore-server re-executes itself once with GLIBC_TUNABLES naming tcache_count=0; the pid
    stays (supervisors and tests that track it see one process). ``--malloc-tcache on`` leaves
    the environment as it is."""
    if "GLIBC_TUNABLES" in os.environ:
        pytest.skip("the suite runs with GLIBC_TUNABLES of its own (tcache_env's own test covers joining them)")
    proc = ServerProcess(tmp_path, *flags)
    proc.start()
    try:
        assert proc.proc is not None
        with open(f"/proc/{proc.proc.pid}/environ") as f:  # the environment of the process's last execve
            environ = dict(entry.split("=", 1) for entry in f.read().split("\0") if "=" in entry)
        assert environ.get("GLIBC_TUNABLES") == (None if flags else TCACHE_OFF)
    finally:
        assert proc.terminate() == 0
        proc.close_pipes()


def test_the_heap_trimmer_gives_free_pages_back(tmp_path) -> None:
    """HeapTrimmer: freed buffers kept on the heap (tune_malloc) leave RssAnon at its next period."""
    script = """
import time
from kvstore.memory import HeapTrimmer, tune_malloc
assert tune_malloc()
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) << 10
keep = []
buffers = []
for _ in range(64):
    buffers.append(bytearray(1 << 20))
    keep.append(bytearray(64))  # small objects above them: the heap's top cannot shrink past these
del buffers
held = anon()
trimmer = HeapTrimmer(0.05)
assert trimmer.start()
deadline = time.monotonic() + 30
while trimmer.trims < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
trimmer.stop()
print(held, anon(), trimmer.trims)
"""
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=60).stdout
    held, after, trims = map(int, out.split())
    assert trims >= 2
    assert held - after >= 48 * MiB, f"RssAnon {held >> 20} -> {after >> 20} MiB"


def test_a_bad_heap_trim_period_is_refused_at_start(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvstore.cli.server", "--data-dir", str(tmp_path), "--heap-trim-s", "-1",
                           "--metrics-listen", "off", "--listen", "127.0.0.1:0"], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--heap-trim-s" in done.stderr
