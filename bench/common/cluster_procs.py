"""Processes of a cluster benchmark: one etcd and kvstore-server nodes on loopback."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvstore.bench.common.harness import KILL_WAIT_S, free_port, stop_process
from kvstore.tiers.host import remove_stale_arenas


def etcd_binary() -> str:
    found = shutil.which("etcd") or shutil.which("etcd", path=os.path.dirname(sys.executable))
    if found is None:
        raise RuntimeError("etcd not found on PATH nor in the venv: run `make etcd`")
    return found


class Etcd:
    def __init__(self, workdir: Path) -> None:
        self.port, peer = free_port(), free_port()
        self.data = tempfile.mkdtemp(prefix="kvstore-bench-etcd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        client, peer_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        with open(workdir / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [etcd_binary(), "--name", "b", "--data-dir", self.data, "--listen-client-urls", client,
                 "--advertise-client-urls", client, "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"b={peer_url}", "--log-level", "warn", "--logger", "zap"], stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                    if b'"health":"true"' in s.recv(4096):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("etcd did not become healthy")

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self.proc, 10)
        shutil.rmtree(self.data, ignore_errors=True)


class Node:
    """A kvstore-server in cluster mode (a single server when ``etcd`` is None);
    ``wait_ready`` returns once it is a member and serves."""

    def __init__(self, workdir: Path, name: str, etcd: Etcd | None, cluster: str, data_plane: str, ttl_s: int,
                 host_capacity: str) -> None:
        self.name = name
        self.address = f"127.0.0.1:{free_port()}"
        self.dir = workdir / f"{cluster}-{name}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = [
            sys.executable, "-m", "kvstore.cli.server", "--listen", self.address, "--data-dir", str(self.dir / "data"),
            "--tiers", "host", "--host-capacity", host_capacity, "--metrics-listen", "off", "--log-level", "warning",
        ]
        if etcd is not None:
            self.args += ["--cluster", etcd.url, "--cluster-name", cluster, "--node-id", name, "--advertise", self.address,
                          "--cluster-ttl", str(ttl_s), "--data-plane", data_plane, "--ucx-tls", "tcp"]
        self.proc: subprocess.Popen[str] | None = None

    def launch(self) -> None:
        with open(self.dir / "server.log", "a") as log:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=log, text=True)

    def wait_ready(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "ready" not in line:
            raise RuntimeError(f"node {self.name} did not start; see {self.dir / 'server.log'}")

    def kill(self) -> None:
        """SIGKILL; then its shared-memory arena, which a killed server cannot unlink (one
        still locked by a live server of that name, another run's, is left alone)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(KILL_WAIT_S)
        remove_stale_arenas(Path("/dev/shm"), self.name)

    def stop(self) -> None:
        stop_process(self.proc)


def start_nodes(workdir: Path, etcd: Etcd | None, cluster: str, names: list[str], data_plane: str, ttl_s: int,
                host_capacity: str) -> list[Node]:
    nodes = [Node(workdir, n, etcd, cluster, data_plane, ttl_s, host_capacity) for n in names]
    for node in nodes:
        node.launch()
    for node in nodes:
        node.wait_ready()
    return nodes
