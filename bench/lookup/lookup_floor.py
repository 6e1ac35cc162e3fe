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


def run(workdir: Path, pages: int, seconds: float, work_ms: float) -> list[dict[str, Any]]:
    """Two rows: the round trip idle, and beside the direct writer (its GB/s where the lookup
    rows put the demoted GB/s); the idle one alone where dd is missing or the filesystem takes no O_DIRECT writes."""
    workdir.mkdir(parents=True, exist_ok=True)
    request_bytes, answer_bytes = sizes(pages)
    path = str(workdir / "floor.sock")  # a Unix socket path has at most 107 bytes: the work dir is short
    echo = subprocess.Popen([sys.executable, "-m", "kvstore.bench.lookup.lookup_floor", "serve", path, str(request_bytes),
                             str(answer_bytes), str(work_ms / 1e3)], stdout=subprocess.PIPE, text=True)
    target = workdir / "floor.dat"
    writer: subprocess.Popen[bytes] | None = None
    try:
        assert echo.stdout is not None
        if echo.stdout.readline().strip() != "ready":
            raise RuntimeError("the echo process did not start")
        rows = [_row("idle", _time(path, request_bytes, answer_bytes, seconds), seconds, 0.0)]
        if shutil.which("dd") is None:
            return rows
        writer = subprocess.Popen(["dd", "if=/dev/zero", f"of={target}", f"bs={WRITE_BLOCK}", "count=100000", "oflag=direct"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # writing at full speed before the window opens
        if writer.poll() is not None:  # e.g. EINVAL: no O_DIRECT on this filesystem
            return rows
        meter = Meter({"dd": writer.pid})
        meter.start()
        before, t0 = target.stat().st_size, time.monotonic()
        beside = _time(path, request_bytes, answer_bytes, seconds)
        written_bytes, window_s = target.stat().st_size - before, time.monotonic() - t0
        dd_cpu = meter.stop()["dd"]
        row = _row("draining", beside, seconds, written_bytes / window_s / 1e9)
        if written_bytes > 0 and dd_cpu > 0:  # the demoter's floor: dd's CPU per GB written, plus one xxh3 pass
            writer.kill()  # hashed with the disk quiet
            writer.wait()
            hashing = hash_cpu_s_per_gb()
            row.update(cpu_s_per_gb=dd_cpu / (written_bytes / 1e9), hash_cpu_s_per_gb=hashing,
                       demote_floor_cpu_s_per_gb=dd_cpu / (written_bytes / 1e9) + hashing)
        return [*rows, row]
    finally:
        if writer is not None:
            writer.kill()
            writer.wait()
        echo.kill()
        echo.wait()
        target.unlink(missing_ok=True)
        Path(path).unlink(missing_ok=True)


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] != "serve":
        raise SystemExit("usage: python -m kvstore.bench.lookup.lookup_floor serve PATH REQUEST_BYTES ANSWER_BYTES WORK_S")
    try:
        serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    except KeyboardInterrupt:  # Ctrl-C reaches the bench's whole process group: the bench itself reports it
        pass
