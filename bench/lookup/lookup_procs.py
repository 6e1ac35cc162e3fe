"""The load processes of a ``kvstore-bench lookup`` run (lookup_load.py ``serve``), kept for the run.

A process per row and role cost the row an interpreter that imports torch (~2 s of CPU each, ten
or more per run, all before any window opened); the windows themselves are as before: each job
connects afresh and warms up, says ``ready`` and waits for the start time its row sends all of
them. The writers are processes of their own (one of them may be pinned to ``--writer-core``),
the lookup clients share the bench's CPUs.

More: bench/lookup/README.md (### lookup_procs.py).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from typing import Any

from kvstore.bench.common.harness import KILL_WAIT_S

RESULT_TIMEOUT_S = 300.0  # the longest wait for a load process's next line ("ready", its result)


class Loads:
    """Idle load processes by kind ("client", "writer"); a kind with none idle starts another."""

    def __init__(self, clients: int, writers: int = 1, writer_core: int = -1) -> None:
        self.writer_core = writer_core
        self._idle: dict[str, list[subprocess.Popen[bytes]]] = {"client": [], "writer": []}
        self._kind: dict[subprocess.Popen[bytes], str] = {}  # every process of the run, idle or not
        self._unread: dict[subprocess.Popen[bytes], bytes] = {}  # what a process printed past its last line read
        for kind, number in (("client", clients), ("writer", writers)):  # importing meanwhile, while the servers start
            self._idle[kind] += [self._start(kind) for _ in range(number)]

    def _start(self, kind: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.bench.lookup.lookup_load", "serve"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        if kind == "writer" and self.writer_core >= 0:
            os.sched_setaffinity(proc.pid, {self.writer_core})
        self._kind[proc], self._unread[proc] = kind, b""
        return proc

    def spawn(self, role: str, address: str, pages: int, seconds: float, rate: float = 0.0, count: int = 0,
              number: int = 1, writer: tuple[float, float] | None = None) -> list[subprocess.Popen[bytes]]:
        """``number`` jobs of ``role`` (with ``writer``, first in the list a writer's job of that many
        seconds at that rate), each ready: connected, warmed up, waiting for its start time."""
        jobs = [("writer", {"role": "writer", "seconds": writer[0], "rate": writer[1]})] if writer else []
        jobs += [("writer" if role == "writer" else "client", {"role": role, "seconds": seconds, "rate": rate,
                                                                "count": count})] * number
        procs = []
        for kind, job in jobs:
            proc = self._idle[kind].pop() if self._idle[kind] else self._start(kind)
            procs.append(proc)
            _send(proc, json.dumps({**job, "address": address, "pages": pages}))
        for proc, (_, job) in zip(procs, jobs, strict=True):
            if self._line(proc) != "ready":
                for other in procs:
                    self.discard(other)
                raise RuntimeError(f"load process {job['role']} did not get ready")
        return procs

    def collect(self, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        """What ``proc``'s job measured (its JSON line); the process is idle again."""
        try:
            while (line := self._line(proc)) and not line.startswith("{"):
                pass
        except BaseException:
            self.discard(proc)
            raise
        if not line:
            self.discard(proc)
            raise RuntimeError(f"load process failed with status {proc.poll()}")
        self._idle[self._kind[proc]].append(proc)
        return json.loads(line)  # type: ignore[no-any-return]

    def discard(self, proc: subprocess.Popen[bytes]) -> None:
        """Stops ``proc`` (a job not collected: its window never opened, or the row failed)."""
        if self._kind.pop(proc, None) is None:
            return
        self._unread.pop(proc, None)
        for idle in self._idle.values():
            if proc in idle:
                idle.remove(proc)
        proc.kill()
        proc.wait(KILL_WAIT_S)

    def close(self) -> None:
        """Every process: idle ones by closing their stdin (they end), the others killed."""
        idle = [proc for procs in self._idle.values() for proc in procs]
        for proc in [p for p in self._kind if p not in idle]:
            self.discard(proc)
        for proc in idle:
            try:
                assert proc.stdin is not None
                proc.stdin.close()
            except OSError:
                pass
        for proc in idle:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(KILL_WAIT_S)
        self._idle, self._kind, self._unread = {"client": [], "writer": []}, {}, {}

    def _line(self, proc: subprocess.Popen[bytes], timeout_s: float = RESULT_TIMEOUT_S) -> str:
        """The next line ``proc`` prints, stripped ("" once it exited)."""
        assert proc.stdout is not None
        buf = self._unread[proc]
        while b"\n" not in buf:
            if not select.select([proc.stdout], [], [], timeout_s)[0]:
                raise TimeoutError(f"load process {proc.pid} said nothing within {timeout_s:.0f} s")
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                self._unread[proc] = b""
                return buf.decode().strip()
            buf += chunk
        line, _, self._unread[proc] = buf.partition(b"\n")
        return line.decode().strip()


def go(procs: list[subprocess.Popen[bytes]], start: float) -> None:
    """Sends the start time (wall clock) to jobs that are ready."""
    for proc in procs:
        _send(proc, f"{start}")


def _send(proc: subprocess.Popen[bytes], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()
