"""The cluster a chaos run drives: one etcd and N kvstore-server nodes on loopback, each
node behind two proxies a fault can cut or hold (node -> proxy -> etcd, and peers -> proxy ->
node on its advertised address; clients reach a node's --listen address directly). Nodes
run with an --auth-file of two tenants and a node identity, and restart on the same ports
and data."""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvstore.bench.chaos.proxy import Proxy
from kvstore.bench.chaos.ssd_flip import SsdDamage, flip_ssd
from kvstore.bench.common.cluster_procs import etcd_binary
from kvstore.bench.common.harness import KILL_WAIT_S, free_port, rss, stop_process
from kvstore.tiers.host import ARENA_HEADER_BYTES, remove_stale_arenas

TTL_S = 2
FETCH_TIMEOUT_S = 1.5
START_TIMEOUT_S = 60.0  # a node's python start on 2 busy cores takes ~3 s; an etcd that stays away is a finding
NODE_TOKEN = "chaos-cluster-node-token-0123456789"
FLIP_SPAN_BYTES = 2 << 20  # arena_flip's bytes land in the lowest 2 MiB of an arena (128 pages of the model's)


@dataclass(frozen=True)
class Tenant:
    name: str
    token: str


TENANTS = (Tenant("a", "chaos-tenant-a-token-0123456789ab"), Tenant("b", "chaos-tenant-b-token-0123456789ab"))


class EtcdServer:
    """etcd on fixed loopback ports, its data on tmpfs (etcd fsyncs every commit): killable,
    restartable on its data, or replaced by an empty one on the same ports."""

    def __init__(self, log: Path) -> None:
        self.port, self.peer_port = free_port(), free_port()
        self.log = log
        self.data_dir = self._new_data_dir()
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def _new_data_dir() -> Path:
        return Path(tempfile.mkdtemp(prefix="kvstore-chaos-etcd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))

    def start(self, timeout_s: float = 20.0) -> None:
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        args = [etcd_binary(), "--name", "chaos", "--data-dir", str(self.data_dir), "--listen-client-urls", client,
                "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"chaos={peer}", "--log-level", "warn", "--logger", "zap"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log}")
            if self.healthy():
                return
            time.sleep(0.05)
        raise RuntimeError(f"etcd did not become healthy within {timeout_s} s; see {self.log}")

    def healthy(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                return b'"health":"true"' in s.recv(4096)
        except OSError:
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(KILL_WAIT_S)

    def wipe(self) -> None:
        """Stopped, its data deleted: the next ``start`` is an empty etcd on the same ports."""
        stop_process(self.proc, 10)
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.data_dir = self._new_data_dir()

    def close(self) -> None:
        stop_process(self.proc, 10)
        shutil.rmtree(self.data_dir, ignore_errors=True)


class ChaosNode:
    """A kvstore-server process on fixed ports: ``--listen`` for clients, ``--advertise`` a
    proxy to it for peers, and its etcd reached through a proxy of its own. ``data_plane``
    "tcp": pages between nodes go over its TCP data port, which peers reach through a proxy
    too (``data_link``: a slow data link holds both); "ucx": over UCX (TCP on loopback) on a
    port of its choosing, with no proxy: UCX connects to addresses it exchanges at wire-up
    (DESIGN §12.9), so ``faults.kinds_for`` leaves the data link's faults out."""

    def __init__(self, workdir: Path, name: str, etcd: EtcdServer, auth_file: Path, salts: str, log_level: str,
                 data_plane: str = "grpc") -> None:
        self.name = name
        self.port = free_port()
        self.metrics_port = free_port()
        self.inbound = Proxy(("127.0.0.1", self.port))
        self.etcd_link = Proxy(("127.0.0.1", etcd.port))
        data_port = free_port() if data_plane == "tcp" else 0
        self.data_link = Proxy(("127.0.0.1", data_port)) if data_plane == "tcp" else None
        plane = ["--data-plane", "grpc"] if self.data_link is None else [
            "--data-plane", "tcp", "--data-port", str(data_port), "--advertise-data-port", str(self.data_link.port)]
        if data_plane == "ucx":  # a new data port at each restart, published with its membership (DESIGN §12.1)
            plane = ["--data-plane", "ucx", "--ucx-tls", "tcp"]
        self.dir = workdir / name
        data = self.dir / "data"
        data.mkdir(parents=True, mode=0o700)
        (data / "tenant-salts.json").write_text(salts)  # every node the same salts: one namespace id per tenant
        (data / "tenant-salts.json").chmod(0o600)
        self.log = self.dir / "server.log"
        self.args = [
            sys.executable, "-m", "kvstore.cli.server", "--listen", self.address, "--data-dir", str(data),
            "--ssd-dir", str(self.dir / "ssd"), "--host-capacity", "64MiB", "--ssd-capacity", "256MiB",
            "--metrics-listen", f"127.0.0.1:{self.metrics_port}", "--log-level", log_level, "--ssd-dwpd", "0",
            "--ssd-admission", "all", "--scrub-rate", "0", "--cluster", f"etcd://{self.etcd_link.address}", "--node-id", name,
            "--advertise", self.inbound.address, "--cluster-ttl", str(TTL_S), *plane,
            "--fetch-timeout-s", str(FETCH_TIMEOUT_S), "--auth-file", str(auth_file),
        ]
        self.proc: subprocess.Popen[str] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def links(self) -> list[Proxy]:
        """The proxies peers reach it through: its gRPC address, and its data port over TCP (none over UCX)."""
        return [self.inbound] if self.data_link is None else [self.inbound, self.data_link]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()  # the previous process's
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=log, text=True,
                                         env={**os.environ, "KVSTORE_CLUSTER_TOKEN": NODE_TOKEN})

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until the node prints its ready line; RuntimeError (the process killed) if it exits or stays silent."""
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if "ready" not in line:
            self.proc.kill()
            self.proc.wait(KILL_WAIT_S)
            raise RuntimeError(f"node {self.name} did not start within {timeout_s} s: {line!r}; see {self.log}")

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def kill(self) -> None:
        """SIGKILL (resumed first if stopped, so that it dies at once), and its arena unlinked."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(KILL_WAIT_S)
        remove_stale_arenas(Path("/dev/shm"), self.name)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)

    def flip_arena_bytes(self, rng: random.Random, count: int, span: int = FLIP_SPAN_BYTES) -> str:
        """Inverts ``count`` bytes at random places of the first ``span`` bytes past the header of
        this node's host arenas (a tenant's is a memfd, reached through /proc/<pid>/fd as root), as
        a stray write would; slots are taken lowest first, so that is where pages are. Says how
        many bytes went to how many arenas."""
        if not self.running:
            return "node down"
        assert self.proc is not None
        arenas: dict[tuple[int, int], int] = {}  # (device, inode) -> an open descriptor
        try:
            for fd in sorted(Path(f"/proc/{self.proc.pid}/fd").iterdir(), key=lambda p: int(p.name)):
                try:
                    link = os.readlink(fd)
                    if f"kvstore-{self.name}-" not in link or not ("memfd:" in link or link.startswith("/dev/shm/")):
                        continue
                    opened = os.open(fd, os.O_RDWR)
                except OSError:  # closed meanwhile
                    continue
                st = os.fstat(opened)
                if (st.st_dev, st.st_ino) in arenas or st.st_size <= ARENA_HEADER_BYTES:
                    os.close(opened)
                else:
                    arenas[(st.st_dev, st.st_ino)] = opened
            chosen = sorted(arenas.values())
            for _ in range(count if chosen else 0):
                fd = rng.choice(chosen)
                offset = rng.randrange(ARENA_HEADER_BYTES, min(os.fstat(fd).st_size, ARENA_HEADER_BYTES + span))
                os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
            return f"{count if chosen else 0} bytes in {len(chosen)} arenas"
        finally:
            for opened in arenas.values():
                os.close(opened)

    def flip_ssd_bytes(self, rng: random.Random, count: int) -> SsdDamage | None:
        """Inverts ``count`` bytes of pages this node's SSD tier indexes (ssd_flip.py), the node
        stopped meanwhile: no slot it holds is freed and written again under the flip, so the
        pages returned are all that were hit. None while the node is down."""
        if not self.running:
            return None
        self.pause()
        try:
            return flip_ssd(self.dir / "ssd", rng, count)
        finally:
            self.resume()

    def resources(self) -> dict[str, int]:
        """RSS parts (bytes) and open descriptors, from /proc, and the C heap's ``heap_in_use`` and
        ``heap_free`` from the node's /metrics (absent where its C library does not say)."""
        assert self.proc is not None
        return {**rss(self.proc.pid), "fds": len(os.listdir(f"/proc/{self.proc.pid}/fd")), **self._heap()}

    def _heap(self) -> dict[str, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        found = re.findall(r'^kvstore_heap_bytes\{state="(\w+)"\} (\S+)$', text, re.MULTILINE)
        return {f"heap_{state}": int(float(value)) for state, value in found}

    def close(self) -> None:
        stop_process(self.proc, 20)
        for link in self.links:
            link.close()
        self.etcd_link.close()
        remove_stale_arenas(Path("/dev/shm"), self.name)


class ChaosCluster:
    """etcd and ``num_nodes`` nodes; the first is the steady node (never killed: its RSS and
    descriptors are compared across histories). ``close()`` stops everything, also on error."""

    def __init__(self, workdir: Path, num_nodes: int = 3, log_level: str = "warning", data_plane: str = "grpc") -> None:
        self.workdir = workdir
        self.data_plane = data_plane
        workdir.mkdir(parents=True, exist_ok=True)
        self.etcd = EtcdServer(workdir / "etcd.log")
        auth = workdir / "auth.json"
        tokens = [{"tenant": t.name, "rights": ["read", "write"], "token": t.token} for t in TENANTS]
        auth.write_text(json.dumps({"tokens": [*tokens, {"tenant": "cluster", "rights": ["node"], "token": NODE_TOKEN}]}))
        auth.chmod(0o600)
        salts = json.dumps({"version": 1, "salts": {t: secrets.token_bytes(16).hex() for t in ("a", "b", "cluster")}})
        run_id = f"{os.getpid() % 100000}"  # node ids name /dev/shm arenas: distinct from other runs' on this host
        self.nodes = [ChaosNode(workdir, f"chaos{run_id}-n{i + 1}", self.etcd, auth, salts, log_level, data_plane)
                      for i in range(num_nodes)]
        self.steady = self.nodes[0]

    def start(self) -> None:
        self.etcd.start()
        for node in self.nodes:
            node.launch()
        for node in self.nodes:
            node.wait_ready()

    def node(self, name: str) -> ChaosNode:
        return next(n for n in self.nodes if n.name == name)

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self.etcd.close()
