"""The benchmarks' child-process harness."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

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
