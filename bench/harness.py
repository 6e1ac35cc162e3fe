"""Starting real processes for benchmarks: kvstore-server and the raw gRPC pump."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process:
    """A child process that prints one 'ready' line when it serves."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **env} if env else None)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "ready" not in line:
            self.proc.kill()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"{args[2]} did not start: {line}{err}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(workdir: Path, host_bytes: int, ssd_bytes: int, *extra: str,
                 env: dict[str, str] | None = None) -> tuple[Process, str]:
    """kvstore-server on a free loopback port; ``extra`` flags, ``env`` added to the environment."""
    port = free_port()
    args = [
        sys.executable, "-m", "kvstore.cli.server", "--listen", f"127.0.0.1:{port}", "--data-dir", str(workdir / "data"),
        "--ssd-dir", str(workdir / "ssd"), "--host-capacity", str(host_bytes), "--ssd-capacity", str(ssd_bytes),
        "--metrics-listen", "off", "--log-level", "warning", *extra,
    ]
    return Process(args, env), f"127.0.0.1:{port}"


def start_raw_grpc() -> tuple[Process, str]:
    port = free_port()
    return Process([sys.executable, "-m", "kvstore.bench.rawgrpc", "--port", str(port)]), f"127.0.0.1:{port}"


def rss(pid: int) -> dict[str, int]:
    """A process's resident memory in bytes: ``rss`` (VmRSS) and its parts ``anon`` (heap),
    ``file`` (mapped files, e.g. LMDB) and ``shmem`` (the shared-memory arena)."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in fields:
                out[fields[name]] = int(value.split()[0]) * 1024
    return out
