"""A real etcd for the cluster tests (import the ``etcd`` fixture from here): one process per test on free loopback ports, its data
in the test's tmp dir, stoppable, killable, pausable and restartable on the same ports."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.bench.common.harness import KILL_WAIT_S, free_port, stop_process


def etcd_binary() -> str:
    """etcd on PATH if there is one, else the copy `make test` unpacks beside the venv's python."""
    found = shutil.which("etcd") or shutil.which("etcd", path=os.path.dirname(sys.executable))
    if found is None:
        raise RuntimeError("etcd not found on PATH nor in the venv: run `make test` (it installs Debian's etcd-server)")
    return found


class PortTaken(RuntimeError):
    """etcd could not bind a port it was given: something took it after free_port() saw it free."""


class EtcdProcess:
    def __init__(self, tmp: Path, *extra: str) -> None:
        self.extra = list(extra)  # more etcd flags (e.g. a longer election timeout, which raises its shortest lease)
        self.client_port, self.peer_port = free_port(), free_port()
        # tmpfs: etcd fsyncs every commit, and a disk busy with other tests' fsyncs would slow
        # its lease expiry and watches past the bounds the tests check
        self.data_dir = Path(tempfile.mkdtemp(prefix="kvstore-etcd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        self.log = tmp / "etcd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"etcd://{self.endpoint}"

    def start(self, timeout_s: float = 20.0) -> None:
        first = self.proc is None
        for attempt in range(3):
            try:
                return self._start(timeout_s)
            except PortTaken:
                if not first or attempt == 2:  # a restart must keep its ports: the nodes know only these
                    raise
                self.client_port, self.peer_port = free_port(), free_port()
                shutil.rmtree(self.data_dir, ignore_errors=True)  # nothing in it: etcd never served
                self.data_dir.mkdir()

    def _start(self, timeout_s: float) -> None:
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        args = [etcd_binary(), "--name", "t", "--data-dir", str(self.data_dir), "--listen-client-urls", client,
                "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"t={peer}", "--log-level", "warn", "--logger", "zap", *self.extra]
        logged = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        # etcd has no readiness signal on stdout; its client port answering /health is the signal.
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "address already in use" in self.log.read_bytes()[logged:].decode(errors="replace"):
                    raise PortTaken(self.log.read_text()[-2000:])
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.5) as s:
                    s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                    if b'"health":"true"' in s.recv(4096):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"etcd did not become healthy within {timeout_s} s: {self.log.read_text()[-2000:]}")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(KILL_WAIT_S)

    def stop(self) -> None:
        try:
            stop_process(self.proc, 10)
        finally:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def wipe(self) -> None:
        """etcd replaced by an empty one on the same ports (its disk lost, rebuilt without a backup)."""
        self.stop()  # deletes the data dir; start() makes a new one
        self.start()


@pytest.fixture(name="etcd")
def etcd_fixture(tmp_path: Path) -> Iterator[EtcdProcess]:
    proc = EtcdProcess(tmp_path)
    proc.start()
    yield proc
    proc.stop()
