"""kvstore-bench fuzz stops on SIGTERM (kill, `timeout`, a CI limit) and leaves no process behind.

Why: `timeout 600 kvstore-bench fuzz --methods Replicate` ran on for two hours. No method it
fuzzed is served on the call socket, so the socket phase looked for a case forever in a worker
thread, and the SIGTERM path (asyncio.run's shutdown) waited for that thread.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.timeout(90)
def test_a_fuzz_run_of_methods_the_call_socket_does_not_serve_ends_on_sigterm(tmp_path: Path) -> None:
    bench = subprocess.Popen([sys.executable, "-m", "kvstore.bench.main", "fuzz", "--methods", "Replicate", "--calls", "1",
                              "--socket-calls", "1000000", "--dir", str(tmp_path / "fz")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while not started and time.monotonic() < deadline and bench.poll() is None:
            started = _children(bench.pid)
            time.sleep(0.05)
        assert started, "the fuzz run started no server"
        try:  # by then its seed and its one gRPC call are done: the call-socket phase is under way
            bench.wait(timeout=3)
        except subprocess.TimeoutExpired:
            bench.send_signal(signal.SIGTERM)
            bench.wait(timeout=15)
    finally:
        bench.kill()
        bench.wait()
    time.sleep(0.2)
    left = [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for pid in left:  # a failed run must leave nothing running either
        psutil.Process(pid).kill()
    assert not left, "the fuzz run's server outlived it"
