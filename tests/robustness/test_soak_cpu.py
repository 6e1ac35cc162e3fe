"""soak_cpu: CPU seconds per op of the server and the clients over a phase's measured window."""

from __future__ import annotations

import subprocess
import sys
import time

from kvstore.bench.soak import soak_cpu, soak_rounds


def _burner(seconds: float) -> subprocess.Popen[bytes]:
    """A real process that spends about ``seconds`` of CPU, then sleeps."""
    code = f"import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\ntime.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", code])


def test_the_window_counts_cpu_spent_after_it_opens_per_op() -> None:
    server, client = _burner(0.6), _burner(0.0)
    try:
        window = soak_cpu.Window(server.pid, [client.pid], opens_at=time.time())
        window.tick(time.time())
        deadline = time.time() + 30
        while (soak_cpu.cpu_seconds(server.pid) or 0) < 0.6 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        window.tick(time.time())
        used = window.summary(ops_per_s=100.0)
        assert 0.3 <= used["server_cpu_s"] <= 0.7, used  # part of its burn came before the window opened, maybe
        assert used["clients_cpu_s"] < 0.2, used
        ops = 100.0 * used["window_s"]
        assert abs(used["server_ms_per_op"] - used["server_cpu_s"] / ops * 1e3) < 0.02 * used["server_ms_per_op"]
    finally:
        for proc in (server, client):
            proc.kill()
            proc.wait()


def test_a_window_that_never_opened_or_lost_a_process_reports_nothing() -> None:
    assert soak_cpu.Window(1, [], opens_at=time.time() + 3600).summary(100.0)["server_ms_per_op"] is None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert soak_cpu.cpu_seconds(gone.pid) is None
    window = soak_cpu.Window(gone.pid, [], opens_at=0.0)
    window.tick(time.time())
    assert window.summary(100.0)["server_cpu_s"] is None


def test_the_rounds_cpu_increase_is_the_median_of_round_pairs() -> None:
    base = [[1.0, 10.0], [1.0, 10.0], [2.0, None]]
    other = [[1.1, 10.0], [1.3, 11.0], [2.0, 12.0]]
    assert soak_rounds.cpu_increase(base, other) == {"server": 0.1, "clients": 0.05}
    assert soak_rounds.cpu_increase([], []) == {"server": None, "clients": None}
