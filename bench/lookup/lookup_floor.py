"""The floor under kvstore-bench lookup's rows: a bare Unix-socket round trip of a Lookup's
sizes, no kvstore at all, timed idle and beside a full-speed O_DIRECT writer.

More: bench/lookup/README.md (### lookup_floor.py).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstore._proto import directory_pb2
from kvstore.bench.common.cpu_floor import HashPass, Meter
from kvstore.bench.common.harness import percentile
from kvstore.bench.lookup.lookup_load import LOOKUP_LAYOUT, LOOKUP_NS, prefix_tokens
from kvstore.callsocket import frames
from kvstore.keys import page_keys

CALL = "bare round trip (no kvstore)"
WRITE_BLOCK = "2M"  # dd's bs: the demoter's pwritev batches are of this order
HASH_BYTES = 256 << 20  # the floor's xxh3 pass: over this many bytes, in 2 MiB pieces (dd's blocks)


def sizes(pages: int) -> tuple[int, int]:
    """(request, answer) bytes of a ``pages``-page Lookup on the call socket, frame headers included."""
    keys = page_keys(LOOKUP_NS.namespace_id, prefix_tokens(pages), LOOKUP_LAYOUT.page_tokens)
    request = directory_pb2.LookupRequest(namespace_id=LOOKUP_NS.namespace_id, keys=keys).ByteSize()
    answer = directory_pb2.LookupResponse(num_pages=pages, runs=[directory_pb2.LocationRun(
        node="node-0", tier="host", num_pages=pages, size_bytes=pages * LOOKUP_LAYOUT.page_bytes)]).ByteSize()
    return frames.REQUEST_HEADER.size + request, frames.ANSWER_HEADER.size + answer


def _exactly(conn: socket.socket, buf: memoryview) -> bool:
    got = 0
    while got < len(buf):
        n = conn.recv_into(buf[got:])
        if n == 0:
            return False
        got += n
    return True


def serve(path: str, request_bytes: int, answer_bytes: int, work_s: float) -> None:
    """The echo process: on each connection in turn, reads requests of ``request_bytes`` and
    answers ``answer_bytes`` to each after ``work_s`` of busy work, until the peer closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    print("ready", flush=True)
    request, answer = memoryview(bytearray(request_bytes)), bytes(answer_bytes)
    while True:
        conn, _ = listener.accept()
        with conn:
            try:
                while _exactly(conn, request):
                    until = time.perf_counter() + work_s
                    while time.perf_counter() < until:  # a server's work on the request: the caller sleeps meanwhile
                        pass
                    conn.sendall(answer)
            except (ConnectionResetError, BrokenPipeError):  # the caller went away (a stopped bench): the next one
                pass


def _time(path: str, request_bytes: int, answer_bytes: int, seconds: float) -> list[float]:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request, answer = os.urandom(request_bytes), memoryview(bytearray(answer_bytes))
    latencies: list[float] = []
    end = time.monotonic() + seconds
    with conn:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            conn.sendall(request)
            if not _exactly(conn, answer):
                raise RuntimeError("the echo process closed its socket")
            latencies.append(time.perf_counter() - t0)
    return latencies


def _row(state: str, latencies: list[float], seconds: float, written_gb_per_s: float) -> dict[str, Any]:
    return {"state": state, "call": CALL, "path": "Unix socket", "clients": 1, "lookups": len(latencies),
            "lookups_per_s": len(latencies) / seconds,
            "p50_ms": percentile(latencies, 0.50) * 1e3, "p99_ms": percentile(latencies, 0.99) * 1e3,
            "short_answers": 0, "writer_pages": 0, "writer_pages_per_s": 0.0, "demoted_gb_per_s": written_gb_per_s,
            "floor_writer": f"dd oflag=direct bs={WRITE_BLOCK}" if state == "draining" else ""}


def hash_cpu_s_per_gb(passes: int = 2) -> float:
    """CPU seconds of one xxh3 pass per GB, page by page on two threads as cpu_floor's floors hash."""
    hashing = HashPass(np.full(HASH_BYTES, 0x5A, dtype=np.uint8), 2 << 20)
    try:
        hashing.run()  # warm: the pool's threads started, the buffer's pages faulted in
        meter = Meter({"hash": os.getpid()})
        meter.start()
        for _ in range(passes):
            hashing.run()
        return meter.stop()["hash"] / (passes * HASH_BYTES / 1e9)
    finally:
        hashing.close()


class Floor:
    """The echo process, and its windows as the bench asks for them: interleaved with the
    bench's own (each idle window of a one-client row beside one of the floor's, each drain
    beside one of dd's), their calls pooled, so that both see the machine in the same state.
    Measured once, minutes before the drains, the floor's draining p99 moved 2-3x from run to
    run on a shared 2-core VM while the lookups' did not."""

    def __init__(self, workdir: Path, pages: int, work_ms: float) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.request_bytes, self.answer_bytes = sizes(pages)
        self.path = str(workdir / "floor.sock")  # a Unix socket path has at most 107 bytes: the work dir is short
        self.target = workdir / "floor.dat"
        self.echo = subprocess.Popen([sys.executable, "-m", "kvstore.bench.lookup.lookup_floor", "serve", self.path,
                                      str(self.request_bytes), str(self.answer_bytes), str(work_ms / 1e3)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.echo.stdout is not None
        if self.echo.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError("the echo process did not start")
        self.idle: list[float] = []
        self.idle_s = 0.0
        self.beside: list[float] = []
        self.beside_s = self.written_bytes = self.written_s = self.dd_cpu_s = 0.0
        self.direct = shutil.which("dd") is not None  # False also once dd found no O_DIRECT here

    def idle_window(self, seconds: float) -> None:
        self.idle += _time(self.path, self.request_bytes, self.answer_bytes, seconds)
        self.idle_s += seconds

    def writer_window(self, seconds: float) -> None:
        """A window beside ``dd oflag=direct``, begun half a second before it (at full speed)."""
        if not self.direct:
            return
        writer = subprocess.Popen(["dd", "if=/dev/zero", f"of={self.target}", f"bs={WRITE_BLOCK}", "count=100000",
                                   "oflag=direct"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.5)
            if writer.poll() is not None:  # e.g. EINVAL: no O_DIRECT on this filesystem
                self.direct = False
                return
            meter = Meter({"dd": writer.pid})
            meter.start()
            before, t0 = self.target.stat().st_size, time.monotonic()
            self.beside += _time(self.path, self.request_bytes, self.answer_bytes, seconds)
            self.written_bytes += self.target.stat().st_size - before
            self.written_s += time.monotonic() - t0
            self.dd_cpu_s += meter.stop()["dd"]
            self.beside_s += seconds
        finally:
            writer.kill()
            writer.wait()
            self.target.unlink(missing_ok=True)

    def rows(self) -> list[dict[str, Any]]:
        """The idle row and the row beside dd (its GB/s where the lookup rows put the demoted
        GB/s, and the demoter's CPU floor), each where its windows ran."""
        rows = [_row("idle", self.idle, self.idle_s, 0.0)] if self.idle else []
        if not self.beside:
            return rows
        row = _row("draining", self.beside, self.beside_s, self.written_bytes / self.written_s / 1e9)
        if self.written_bytes > 0 and self.dd_cpu_s > 0:  # the demoter's floor: dd's CPU per GB written, plus one xxh3 pass
            hashing = hash_cpu_s_per_gb()  # with the disk quiet
            per_gb = self.dd_cpu_s / (self.written_bytes / 1e9)
            row.update(cpu_s_per_gb=per_gb, hash_cpu_s_per_gb=hashing, demote_floor_cpu_s_per_gb=per_gb + hashing)
        return [*rows, row]

    def close(self) -> None:
        self.echo.kill()
        self.echo.wait()
        self.target.unlink(missing_ok=True)
        Path(self.path).unlink(missing_ok=True)


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] != "serve":
        raise SystemExit("usage: python -m kvstore.bench.lookup.lookup_floor serve PATH REQUEST_BYTES ANSWER_BYTES WORK_S")
    try:
        serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    except KeyboardInterrupt:  # Ctrl-C reaches the bench's whole process group: the bench itself reports it
        pass
