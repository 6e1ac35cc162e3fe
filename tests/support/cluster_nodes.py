"""kvstore-server nodes of one cluster as child processes (killable, stoppable, restartable
on the same ports and data), over a real etcd (``etcd_proc``)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, Namespace
from kvstore.bench.common.harness import KILL_WAIT_S, stop_process
from kvstore.tiers.host import remove_stale_arenas
from support.etcd_proc import EtcdProcess, free_port
from support.servers import freeze

TTL_S = 2
# the cluster tests' layout and namespace, and a chain of page tokens from a seed
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)
NS = Namespace(model="cluster", revision="r1", layout=LAYOUT)


def tokens_of(seed: int, pages: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (pages * LAYOUT.page_tokens,), generator=g).tolist()


class Node:
    def __init__(self, tmp: Path, name: str, etcd_url: str, data_plane: str, *extra: str) -> None:
        self.name = name
        self.port = free_port()
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = self.dir / "server.log"
        self.args = [
            sys.executable, "-m", "kvstore.cli.server", "--listen", self.address, "--data-dir", str(self.dir / "data"),
            "--ssd-dir", str(self.dir / "ssd"), "--host-capacity", "64MiB", "--ssd-capacity", "256MiB",
            "--metrics-listen", "off", "--log-level", "info", "--ssd-dwpd", "0", "--ssd-admission", "all",
            "--scrub-rate", "0", "--cluster", etcd_url, "--node-id", name, "--advertise", self.address,
            "--cluster-ttl", str(TTL_S), "--data-plane", data_plane, "--ucx-tls", "tcp", "--fetch-timeout-s", "1.5", *extra,
        ]
        self.proc: subprocess.Popen[str] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def launch(self) -> None:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=log, text=True)

    def wait_ready(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "ready" not in line:
            self.proc.kill()
            raise RuntimeError(f"node {self.name} did not start: {line}{self.log.read_text()[-3000:]}")

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def signal(self, sig: int) -> None:
        """Sends ``sig`` and returns: a SIGSTOP may not have stopped the node yet (``freeze`` waits)."""
        assert self.proc is not None
        self.proc.send_signal(sig)

    def freeze(self) -> None:
        """SIGSTOP, returning once every thread of the node is stopped (support.servers.freeze)."""
        assert self.proc is not None
        freeze(self.proc)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(KILL_WAIT_S)

    def stop(self) -> None:
        stop_process(self.proc, 20)


@pytest.fixture(name="cluster_nodes")
def cluster_nodes_fixture(tmp_path: Path, etcd: object) -> Iterator[Callable[..., list[Node]]]:
    """``start(names, data_plane, *extra, each={name: flags})`` -> the nodes, started in parallel and
    all members; ``extra`` flags for every node, ``each`` a node's own after them (its certificate, say)."""
    started: list[Node] = []

    def start(names: list[str], data_plane: str = "ucx", *extra: str, each: dict[str, list[str]] | None = None) -> list[Node]:
        nodes = [Node(tmp_path, name, etcd.url, data_plane, *extra, *(each or {}).get(name, ()))  # type: ignore[attr-defined]
                 for name in names]
        for node in nodes:
            node.launch()
            started.append(node)
        for node in nodes:
            node.wait_ready()
        return nodes

    yield start
    for node in started:
        node.stop()
    for name in {node.name for node in started}:  # the arenas of nodes a test SIGKILLed and never restarted
        remove_stale_arenas(Path("/dev/shm"), name)


async def eventually(check: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.05) -> float:
    """Polls an async ``check`` until it returns truthy; returns the seconds it took."""
    start = time.monotonic()
    while True:
        if await check():  # type: ignore[misc]
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} not within {timeout_s} s")
        await asyncio.sleep(every_s)


@contextmanager
def pd_nodes(tmp: Path, prepare: Callable[[dict[str, Node]], None] = lambda nodes: None) -> Iterator[dict[str, Node]]:
    """A prefill node ``np`` and a decode node ``nd`` (gRPC data plane) on an etcd of their own,
    started once ``prepare`` changed their arguments; stopped, etcd and their arenas gone, at the end."""
    etcd = EtcdProcess(tmp)
    etcd.start()
    started = {name: Node(tmp, name, etcd.url, "grpc") for name in ("np", "nd")}
    prepare(started)
    try:
        for node in started.values():
            node.launch()
        for node in started.values():
            node.wait_ready()
        yield started
    finally:
        for node in started.values():
            node.stop()
        etcd.stop()
        for name in started:
            remove_stale_arenas(Path("/dev/shm"), name)
