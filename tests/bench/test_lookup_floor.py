"""The lookup bench's floor echo (bench/lookup/lookup_floor.py) as a process: a caller that goes
away mid-request or a Ctrl-C must not print a traceback into the bench's output."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

from kvstore.bench.lookup import lookup_floor

# Ctrl-C as a terminal gives it: a suite started in the background by a shell without job control runs with SIGINT
# ignored, which a child inherits and Python then leaves ignored, so the echo never stopped (seen: a whole-suite run
# under `nohup ... &`). The child sets its own handler (no preexec_fn: this process has threads).
_INTERRUPTIBLE = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                  "runpy.run_module('kvstore.bench.lookup.lookup_floor', run_name='__main__', alter_sys=True)")


def _echo(path: Path, request_bytes: int, answer_bytes: int) -> subprocess.Popen[str]:
    echo = subprocess.Popen([sys.executable, "-c", _INTERRUPTIBLE, "serve", str(path), str(request_bytes), str(answer_bytes),
                             "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
    return echo


def _round_trip(path: Path, request_bytes: int, answer_bytes: int) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(str(path))
        conn.sendall(bytes(request_bytes))
        got = 0
        while got < answer_bytes:
            chunk = conn.recv(answer_bytes - got)
            assert chunk, "the echo closed before answering"
            got += len(chunk)


def test_a_caller_reset_mid_request_is_no_traceback_and_the_next_caller_is_served(tmp_path: Path) -> None:
    request_bytes, answer_bytes = lookup_floor.sizes(512)
    path = tmp_path / "floor.sock"
    echo = _echo(path, request_bytes, answer_bytes)
    try:
        for _ in range(3):  # a caller that closes with most of its answer unread: the echo's recv fails (ECONNRESET)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as rude:
                rude.settimeout(10)
                rude.connect(str(path))
                rude.sendall(bytes(request_bytes))
                assert rude.recv(1), "no answer"  # the answer is sent; the rest of it stays unread
                rude.sendall(bytes(request_bytes // 2))
        _round_trip(path, request_bytes, answer_bytes)
        assert echo.poll() is None, "the echo process died of a caller that went away"
    finally:
        echo.send_signal(signal.SIGINT)  # Ctrl-C reaches the whole process group
        try:
            _, err = echo.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            echo.kill()  # an echo that did not stop is not left running after the test
            echo.communicate()
            raise
    assert "Traceback" not in err, err
    assert echo.returncode in (0, -signal.SIGINT, 128 + signal.SIGINT), echo.returncode
