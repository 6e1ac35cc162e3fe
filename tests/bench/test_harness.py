"""The benchmarks' child-process harness."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading

from kvstore.bench.common import harness
from kvstore.bench.common.harness import Process, stop_process

CHATTY = "import sys, time; sys.stderr.write('x' * 300_000); sys.stderr.flush(); print('ready', flush=True); time.sleep(60)"


def test_a_server_chatty_on_stderr_still_starts() -> None:
    """Bug: Process piped the child's stderr and never read it; a server writing more than
    a pipe holds (64 KiB) before its ready line blocked, and the start never returned."""
    started: list[Process] = []
    t = threading.Thread(target=lambda: started.append(Process([sys.executable, "-c", CHATTY])), daemon=True)
    t.start()
    t.join(20)
    assert started, "Process() did not return: the child blocked writing its stderr"
    process = started[0]
    assert len(process.stderr_text()) == 300_000
    process.stop()
    assert process.proc.returncode == -signal.SIGTERM


def test_stop_process_resumes_a_stopped_child_and_ends_it() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.send_signal(signal.SIGSTOP)
    stop_process(proc, 10)
    assert proc.returncode == -signal.SIGTERM  # it acted on SIGTERM once resumed, no SIGKILL needed
    stop_process(proc)  # a second stop of an ended child is a no-op


def test_a_scratch_dir_goes_with_a_run_that_ended_well_and_stays_with_one_that_failed(capsys) -> None:
    """Bug: kvstore-bench cluster and calls left their servers' and etcd's directory in /tmp
    after every run (86 of them here)."""
    from kvstore.bench.common.harness import scratch_dir

    with scratch_dir("kvstore-test-scratch-") as ok:
        (ok / "etcd.log").write_text("x")
    assert not ok.exists()
    try:
        with scratch_dir("kvstore-test-scratch-") as failed:
            (failed / "etcd.log").write_text("x")
            raise RuntimeError("the run failed")
    except RuntimeError:
        pass
    assert (failed / "etcd.log").exists() and str(failed) in capsys.readouterr().err
    shutil.rmtree(failed)


def test_test_workers_pick_ports_from_disjoint_shares(monkeypatch) -> None:
    """Two xdist workers handed the same free port: the second child's bind failed. Each worker
    now picks only ports of its own residue (a worker's own picks repeat none either)."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    picked: dict[int, set[int]] = {}
    for index in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        picked[index] = {harness.free_port() for _ in range(20)}
        assert len(picked[index]) == 20 and all(port % 3 == index for port in picked[index])
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert harness._worker_share() == (0, 1)
