"""A kvstore-server that fails to start after its placement core was built leaves nothing behind:
the host arena (reserved in full in /dev/shm: --host-capacity of RAM), the call socket file, the
data directory's lock. Before, the CLI printed the error and exited without stopping what it had
built: the arena stayed in /dev/shm (until the next server of that node swept it) and call.sock in
the data directory. Real processes: a port another process holds, and an etcd nobody serves."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from kvstore.bench.common.harness import free_port

SHM = Path("/dev/shm")


def _server(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "kvstore.cli.server", "--data-dir", str(tmp / "data"), "--ssd-dir", str(tmp / "ssd"),
            "--host-capacity", "64MiB", "--ssd-capacity", "256MiB", "--ssd-dwpd", "0", "--log-level", "warning", *extra]
    return subprocess.run(args, check=False, capture_output=True, text=True, timeout=90)


def _left_behind(tmp: Path, node: str, before: set[str]) -> list[str]:
    arenas = sorted(p.name for p in SHM.glob(f"kvstore-{node}-*") if p.name not in before)
    sockets = sorted(p.name for p in (tmp / "data").glob("*.sock"))
    return arenas + sockets


def test_a_listen_port_in_use_leaves_no_arena(tmp_path: Path) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    before = {p.name for p in SHM.glob("kvstore-*")}
    try:
        done = _server(tmp_path, "--listen", f"127.0.0.1:{held.getsockname()[1]}", "--metrics-listen", "off",
                       "--node", "failedstart")
    finally:
        held.close()
    assert done.returncode == 2, done.stderr
    assert _left_behind(tmp_path, "failedstart", before) == []


def test_an_unreachable_etcd_leaves_no_arena_nor_socket(tmp_path: Path) -> None:
    before = {p.name for p in SHM.glob("kvstore-*")}
    done = _server(tmp_path, "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--cluster", f"etcd://127.0.0.1:{free_port()}",
                   "--node-id", "failedjoin", "--advertise", "127.0.0.1:1", "--cluster-ttl", "2", "--cluster-join-timeout-s", "1.5")
    assert done.returncode == 2, done.stderr
    assert "could not join the cluster" in done.stderr
    assert _left_behind(tmp_path, "failedjoin", before) == []


def test_a_data_port_in_use_leaves_no_arena_nor_socket(tmp_path: Path) -> None:
    """The cluster runtime fails before it made its etcd client and peers (its TCP page server
    cannot bind); leaving the cluster must still let the server stop."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    before = {p.name for p in SHM.glob("kvstore-*")}
    try:
        done = _server(tmp_path, "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--cluster",
                       f"etcd://127.0.0.1:{free_port()}", "--node-id", "failedport", "--advertise", "127.0.0.1:1",
                       "--data-plane", "tcp", "--data-port", str(held.getsockname()[1]))
    finally:
        held.close()
    assert done.returncode == 2, done.stderr
    assert _left_behind(tmp_path, "failedport", before) == []
