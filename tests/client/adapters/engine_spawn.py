"""Starting ``vllm_engine.py`` children through the zygote (engine_zygote.py) when it runs, else as plain
processes: ``popen`` answers what ``subprocess.Popen`` does for the calls EngineProcess makes."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

ZYGOTE = Path(__file__).parent / "engine_zygote.py"
_lock = threading.Lock()
_zygote: tuple[subprocess.Popen[bytes], str] | None = None
_failed = False


class ZygoteChild:
    """A child of the zygote, as much of Popen as the tests use (it is not our child: its exit code comes
    from the zygote over the connection)."""

    def __init__(self, conn: socket.socket, pid: int, stdin: IO[str], stdout: IO[str]) -> None:
        self._conn, self.pid, self.stdin, self.stdout = conn, pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"engine {self.pid}", timeout or 0)
            self._read_exit()
        assert self.returncode is not None
        return self.returncode

    def _read_exit(self) -> None:
        data = b""
        while not data.endswith(b"\n"):
            chunk = self._conn.recv(4096)
            if not chunk:
                break
            data += chunk
        self.returncode = int(json.loads(data)["exit"]) if data else -signal.SIGKILL  # the zygote went: so did it
        self._conn.close()
        for stream in (self.stdin, self.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _start_zygote() -> tuple[subprocess.Popen[bytes], str] | None:
    """The zygote, started once per test process; None where it could not start (then engines start plainly)."""
    global _zygote, _failed
    with _lock:
        if _zygote is None and not _failed:
            path = os.path.join(tempfile.mkdtemp(prefix="kvzygote-"), "sock")
            proc = subprocess.Popen([sys.executable, str(ZYGOTE), path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert proc.stdout is not None
            if proc.stdout.readline().strip() == b"ready":
                _zygote = (proc, path)
                atexit.register(_stop_zygote)
            else:
                proc.kill()
                proc.wait()
                _failed = True
        return _zygote


def _stop_zygote() -> None:
    if _zygote is not None:
        proc, _ = _zygote
        if proc.stdin is not None:
            proc.stdin.close()  # it kills its children and ends
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def popen(argv: list[str], env: dict[str, str], stderr: IO[Any]) -> ZygoteChild | subprocess.Popen[str]:
    """``argv`` (a script and its arguments, no interpreter) with piped stdin/stdout in text mode."""
    zygote = None if os.environ.get("KVSTORE_TEST_NO_ZYGOTE") else _start_zygote()
    if zygote is None:
        return subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                text=True, env=env)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(zygote[1])
        header = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
        socket.send_fds(conn, [header], [in_r, out_w, stderr.fileno()])
        answer = json.loads(conn.makefile("rb").readline())
    finally:
        os.close(in_r)
        os.close(out_w)
    if "pid" not in answer:
        os.close(in_w)
        os.close(out_r)
        conn.close()
        raise RuntimeError(f"the engine zygote did not start the engine: {answer}")
    return ZygoteChild(conn, int(answer["pid"]), os.fdopen(in_w, "w"), os.fdopen(out_r, "r"))
