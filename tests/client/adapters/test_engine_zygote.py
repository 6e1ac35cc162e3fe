"""The engine zygote (engine_zygote.py) stands in for Popen in the engine tests: what they rely on holds."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import engine_spawn

from kvstore.bench.common.harness import KILL_WAIT_S

ECHO = """
import os, sys
print("env", os.environ.get("ZYGOTE_TEST"), flush=True)
for line in sys.stdin:
    if line.strip() == "quit":
        sys.exit(3)
    print(line.strip().upper(), flush=True)
    print("to the log", file=sys.stderr, flush=True)
"""


def test_a_forked_child_talks_over_its_pipes_logs_and_reports_its_exit(tmp_path: Path) -> None:
    script, log = tmp_path / "echo.py", tmp_path / "echo.log"
    script.write_text(ECHO)
    with open(log, "w") as err:
        child = engine_spawn.popen([str(script)], {**os.environ, "ZYGOTE_TEST": "yes"}, err)
    assert isinstance(child, engine_spawn.ZygoteChild), "the zygote did not start"
    assert child.stdout.readline().strip() == "env yes"
    child.stdin.write("hello\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "HELLO" and child.poll() is None
    child.stdin.write("quit\n")
    child.stdin.flush()
    assert child.wait(30) == 3
    assert "to the log" in log.read_text()


def test_a_killed_child_reads_as_killed_and_a_wait_can_time_out(tmp_path: Path) -> None:
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    with open(tmp_path / "log", "w") as err:
        child = engine_spawn.popen([str(script)], dict(os.environ), err)
    assert child.stdout.readline().startswith("env")
    try:
        child.wait(0.2)
        raise AssertionError("a live child's wait returned")
    except subprocess.TimeoutExpired:
        pass
    child.kill()
    assert child.wait(KILL_WAIT_S) == -signal.SIGKILL
