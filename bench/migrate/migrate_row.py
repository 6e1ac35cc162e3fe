"""One row of ``kvstore-bench migrate``: a growing session moved from node a to node b over a
capped link, its catch-up curve sampled, and the raw link measured through a proxy of the same rate.

More: bench/migrate/README.md (### migrate_row.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstore import KVLayout, Namespace
from kvstore._proto import directory_pb2
from kvstore.bench.cluster.cluster_paired import prefix_tokens, random_kv
from kvstore.bench.common.cluster_procs import Etcd, Node
from kvstore.bench.common.harness import free_port
from kvstore.bench.common.linkproxy import LinkProxy
from kvstore.bench.common.proc_stat import cpu_seconds
from kvstore.client import KVStoreClient
from kvstore.errors import CannotConverge, SessionFenced, TierUnavailable

POOL_PAGES = 32  # distinct random pages the writer cycles through (the bytes' content does not matter here)


@dataclass(frozen=True)
class RowSpec:
    copy_bps: float        # the link's cap; inf: not capped (loopback through the proxy)
    growth_bps: float      # the writer's target rate at the source
    initial_bytes: int     # S0: the session's stored pages when the migration starts
    budget_s: float        # how long the writer may grow it (sizes the nodes' host tiers)
    sample_s: float        # the catch-up curve's sampling period at the target (0: round ends only)
    max_pause_ms: float    # client.migrate's: fence once the rest copies within it
    pump_bytes: int        # the raw transfer through a proxy of the same rate
    data_plane: str = "tcp"  # the nodes' --data-plane: how b pulls a's pages


@dataclass
class Trace:
    """What one row saw; times are seconds after the migrate call."""

    link_bps: float = 0.0
    link_cpu_s: float = 0.0
    curve: list[tuple[float, int]] = field(default_factory=list)    # (t, bytes stored at a and not at b), sampled
    rounds: list[tuple[float, int]] = field(default_factory=list)   # (t, bytes not copied) at each round's end
    writes: list[tuple[float, int]] = field(default_factory=list)   # (t, session bytes stored at a)
    summary: dict[str, Any] | None = None
    cannot_converge: str | None = None
    returned_s: float = 0.0
    writer_exhausted: bool = False
    cpu_s: dict[str, float] = field(default_factory=dict)


def raw_link(bandwidth_bps: float, nbytes: int, proxied: bool = True) -> tuple[float, float]:
    """Bytes/s of one raw TCP transfer of ``nbytes`` through a ``LinkProxy`` capped at
    ``bandwidth_bps`` (the copy rate the model takes; not ``proxied``: sender to sink, as UCX's
    pages go), and this process's CPU seconds for it (sender, proxy and sink all run here)."""
    sink = socket.create_server(("127.0.0.1", 0))
    got: list[int] = []

    def drain() -> None:
        conn, _ = sink.accept()
        buf, n = bytearray(1 << 20), 0
        with conn:
            while n < nbytes and (k := conn.recv_into(buf)):
                n += k
            got.append(n)
            conn.sendall(b"k")

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    proxy = LinkProxy(f"127.0.0.1:{sink.getsockname()[1]}", bandwidth_bps) if proxied else None
    chunk = memoryview(bytearray(1 << 20))
    try:
        with socket.create_connection(("127.0.0.1", proxy.port if proxy else sink.getsockname()[1])) as s:
            cpu0, t0 = cpu_seconds(os.getpid()) or 0.0, time.perf_counter()
            sent = 0
            while sent < nbytes:
                s.sendall(chunk[: min(len(chunk), nbytes - sent)])
                sent += min(len(chunk), nbytes - sent)
            if s.recv(1) != b"k":
                raise RuntimeError("the raw transfer's sink did not acknowledge")
            seconds, cpu = time.perf_counter() - t0, (cpu_seconds(os.getpid()) or 0.0) - cpu0
        thread.join(10)
    finally:
        if proxy is not None:
            proxy.close()
        sink.close()
    if got != [nbytes]:
        raise RuntimeError(f"the raw transfer delivered {got} bytes of {nbytes}")
    return nbytes / seconds, cpu


class Writer:
    """The engine at the source: a task of its own saves the session's next page and logs its
    tokens whenever ``growth_bps`` says a page is due, until stopped or fenced (SessionFenced)."""

    def __init__(self, client: KVStoreClient, session_id: str, tokens: list[int], pool: torch.Tensor, start_pages: int,
                 growth_bps: float) -> None:
        self.client, self.session_id, self.tokens, self.pool = client, session_id, tokens, pool
        self.keys = client.keys(tokens)
        self.page = client.layout.page_tokens
        self.page_bytes = client.layout.page_bytes
        self.pages = start_pages
        self.start_pages = start_pages
        self.growth_bps = growth_bps
        self.stopped = False
        self.fenced = False
        self.writes: list[tuple[float, int]] = []

    async def save(self, first: int, count: int) -> None:
        at = first % POOL_PAGES
        if at + count > POOL_PAGES:
            count = POOL_PAGES - at
        kv = self.pool[:, :, at * self.page : (at + count) * self.page]
        stored = await self.client.put_keys(self.keys[first : first + count], kv, session_id=self.session_id)  # refused once fenced
        if stored != count * self.page:
            raise RuntimeError(f"the source stored {stored} of {count * self.page} tokens")
        await self.client.append_tokens(self.session_id, self.tokens[first * self.page : (first + count) * self.page],
                                        expected_length=first * self.page, sync=True)
        self.pages = first + count

    async def fill(self) -> None:
        """The session before the migration: its prompt logged, its pages saved."""
        await self.client.append_tokens(self.session_id, self.tokens[: self.start_pages * self.page], expected_length=0,
                                        sync=True, prompt_tokens=self.start_pages * self.page)
        self.pages = 0
        while self.pages < self.start_pages:
            first = self.pages
            count = min(POOL_PAGES - first % POOL_PAGES, self.start_pages - first)
            kv = self.pool[:, :, (first % POOL_PAGES) * self.page : (first % POOL_PAGES + count) * self.page]
            if await self.client.put_keys(self.keys[first : first + count], kv) != count * self.page:
                raise RuntimeError("the source did not store the session's first pages")
            self.pages += count

    async def run(self, t0: float) -> None:
        total = len(self.keys)
        while not self.stopped and self.pages < total:
            due = self.start_pages + int(self.growth_bps * (time.monotonic() - t0) / self.page_bytes)
            if self.pages >= due:
                await asyncio.sleep(max(0.001, t0 + (due + 1 - self.start_pages) * self.page_bytes / self.growth_bps
                                        - time.monotonic()))
                continue
            try:
                await self.save(self.pages, min(8, due - self.pages, total - self.pages))
            except SessionFenced:  # the fence: this session's writes go to the target now
                self.fenced = True
                return
            except TierUnavailable:  # frozen, the fence not decided yet: as an engine would, try again
                await asyncio.sleep(0.001)
                continue
            self.writes.append((time.monotonic() - t0, self.pages * self.page_bytes))


async def _sample(dst: KVStoreClient, writer: Writer, t0: float, period_s: float, out: list[tuple[float, int]]) -> None:
    """Bytes stored at the source and not yet at the target, every ``period_s``: the pages the
    target's host tier holds (its Stats, answered locally: a lookup there would ask the source's
    shards across the capped link, queued behind the pages). The row's nodes hold this session alone."""
    while True:
        t, stored = time.monotonic() - t0, writer.pages
        stats = await dst.calls.unary("Directory.Stats", directory_pb2.StatsRequest())
        here = sum(tier.num_pages for tier in stats.tiers if tier.tier == "host")
        out.append((t, max(0, stored - here) * writer.page_bytes))
        await asyncio.sleep(period_s)


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) or 0.0 for name, pid in pids.items()}


async def _migrate(a: Node, b: Node, spec: RowSpec, layout: KVLayout, seed: int, trace: Trace, pids: dict[str, int]) -> None:
    ns = Namespace(model="bench-migrate", revision="r1", layout=layout)
    start_pages = max(1, spec.initial_bytes // layout.page_bytes)
    grow_pages = int(spec.growth_bps * spec.budget_s / layout.page_bytes) + 1
    tokens = prefix_tokens(seed, start_pages + grow_pages, layout)
    pool = random_kv(layout, POOL_PAGES * layout.page_tokens, seed)
    session = f"s{seed}"
    async with KVStoreClient(a.address, ns, timeout_s=600) as src, KVStoreClient(a.address, ns, use_shm=False,
                                                                                 timeout_s=600) as ctl, \
            KVStoreClient(b.address, ns, use_shm=False) as dst:
        writer = Writer(src, session, tokens, pool, start_pages, spec.growth_bps)
        await writer.fill()
        done: list[int] = []

        def on_round(_round: int, copied: int, _left: int) -> None:
            done.append(copied)
            trace.rounds.append((time.monotonic() - t0, writer.pages * layout.page_bytes - sum(done)))

        cpu0 = _cpu(pids)
        t0 = time.monotonic()
        trace.curve.append((0.0, writer.pages * layout.page_bytes))
        trace.rounds.append((0.0, writer.pages * layout.page_bytes))
        tasks = [asyncio.create_task(writer.run(t0))]
        if spec.sample_s > 0:
            tasks.append(asyncio.create_task(_sample(dst, writer, t0, spec.sample_s, trace.curve)))
        try:
            summary = await ctl.migrate(session, b.name, max_pause_ms=spec.max_pause_ms, on_round=on_round)
            trace.summary = summary.as_dict()
        except CannotConverge as exc:
            trace.cannot_converge = str(exc)
        finally:
            trace.returned_s = time.monotonic() - t0
            trace.cpu_s = {k: v - cpu0[k] for k, v in _cpu(pids).items()}
            writer.stopped = True
            for task in tasks:
                if not task.done() and task is not tasks[0]:
                    task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result
        trace.writes = [(0.0, start_pages * layout.page_bytes), *writer.writes]
        trace.writer_exhausted = writer.pages >= len(writer.keys) and not writer.fenced
        if trace.summary is not None and not writer.fenced and not trace.writer_exhausted:
            try:  # the writer slept through the pause: one more save must be refused at the source
                await writer.save(writer.pages, 1)
            except SessionFenced:
                writer.fenced = True
        if trace.summary is not None and not writer.fenced and not trace.writer_exhausted:
            raise RuntimeError("the migration ended but the source still took the session's writes (no fence seen)")


def measure_row(workdir: Path, etcd: Etcd, index: int, spec: RowSpec, layout: KVLayout) -> Trace:
    """Starts the row's two nodes (a behind its link proxy), measures the raw link, then the migration."""
    trace = Trace()
    trace.link_bps, trace.link_cpu_s = raw_link(spec.copy_bps, spec.pump_bytes, proxied=spec.data_plane != "ucx")
    grow = int(spec.growth_bps * spec.budget_s) + spec.initial_bytes
    host = f"{(grow + (96 << 20)) >> 20}MiB"
    cluster = f"migrate-{index}"
    nodes = [Node(workdir, name, etcd, cluster, spec.data_plane, 10, host) for name in ("a", "b")]
    proxy = None
    if spec.data_plane == "grpc":  # b fetches a's pages through the proxy (argparse: the last --advertise wins)
        proxy = LinkProxy(nodes[0].address, spec.copy_bps)
        nodes[0].args += ["--advertise", proxy.address]
    elif spec.data_plane == "tcp":  # the pages go over a's data listener: b is told the proxy's port for it, a's gRPC calls go direct
        data_port = free_port()
        proxy = LinkProxy(f"127.0.0.1:{data_port}", spec.copy_bps)
        nodes[0].args += ["--data-port", str(data_port), "--advertise-data-port", str(proxy.port)]
    for node in nodes:
        node.args += ["--fetch-timeout-s", "600", "--scrub-rate", "0"]
    try:
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_ready()
        pids = {"node_a": nodes[0].proc.pid, "node_b": nodes[1].proc.pid, "etcd": etcd.proc.pid,  # type: ignore[union-attr]
                "bench": os.getpid()}
        asyncio.run(_migrate(nodes[0], nodes[1], spec, layout, 100 + index, trace, pids))
    finally:
        for node in nodes:
            node.stop()
        if proxy is not None:
            proxy.close()
    return trace
