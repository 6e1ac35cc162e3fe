"""Remote get beside its raw transport in interleaved, paired rounds (pump, get, pump, get ...).

On a shared 2-core host the bare pump alone moved 0.68-1.34 GB/s between runs, so a get
timed minutes apart from its pump says little. Here each round times one pump of the same
bytes and message size right before one remote get; the ratio is the median of the
per-round ratios, with their spread (min, max) beside it.

More: bench/cluster/README.md (### cluster_paired.py).
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from typing import Any

import grpc
import numpy as np
import torch

from kvstore import Namespace
from kvstore.bench.common import rawgrpc
from kvstore.bench.common.cluster_procs import Node
from kvstore.bench.common.cpu_floor import OWN, Meter, VerifiedCopy, add_cpu, cpu_fields
from kvstore.bench.common.harness import KILL_WAIT_S, start_raw_grpc
from kvstore.client import KVStoreClient
from kvstore.types import KVLayout


class ChildPump:
    """A bare pump in child processes kept up for all rounds: ``round()`` moves ``total``
    bytes as ``batch`` page-sized messages at a time and returns GB/s."""

    def __init__(self, module: str, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        try:
            self.round()  # connects and warms the destinations
        except BaseException:
            self.proc.kill()
            self.proc.wait(KILL_WAIT_S)
            raise

    def round(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        while line := self.proc.stdout.readline():
            if line.startswith("gbps "):  # UCX may print its warnings there too
                return float(line.split()[1])
        raise RuntimeError(f"the pump exited ({self.proc.wait(10)})")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def ucx_pump(tls: str, mode: str, page_bytes: int, batch: int, total: int) -> ChildPump:
    """A bare ucxx pump (``cluster_transport``: a client child and a server child)."""
    return ChildPump("kvstore.bench.cluster.cluster_transport", "--pump-rounds", tls, mode, str(page_bytes), str(batch), str(total))


def tcp_pump(page_bytes: int, batch: int, total: int) -> ChildPump:
    """A bare TCP pump with the TCP plane's socket options (``cluster_tcp_pump``)."""
    return ChildPump("kvstore.bench.cluster.cluster_tcp_pump", "--rounds", str(page_bytes), str(batch), str(total))


class GrpcPump:
    """A bare gRPC download pump (``rawgrpc``) kept up for all rounds."""

    def __init__(self, page_bytes: int, total: int) -> None:
        self.page_bytes, self.total = page_bytes, total
        self.proc, address = start_raw_grpc()
        self.channel = grpc.aio.insecure_channel(address, options=rawgrpc.OPTIONS)

    async def round(self) -> float:
        t0 = time.perf_counter()
        await rawgrpc.download(self.channel, self.total, self.page_bytes)
        return self.total / (time.perf_counter() - t0) / 1e9

    async def close(self) -> None:
        await self.channel.close()
        self.proc.stop()


def prefix_tokens(seed: int, pages: int, layout: KVLayout) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (pages * layout.page_tokens,), generator=g).tolist()


def random_kv(layout: KVLayout, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((layout.num_layers, layout.kv_factor, tokens, layout.num_kv_heads, layout.head_dim),
                       generator=g).to(layout.torch_dtype())


async def _stored_at(client: KVStoreClient, tokens: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (await client.lookup(tokens)).num_tokens != len(tokens):
        if time.monotonic() > deadline:
            raise RuntimeError("node c did not find the prefix stored on node a in time")
        await asyncio.sleep(0.02)


async def paired_rounds(plane: str, a: Node, c: Node, layout: KVLayout, pages: int, rounds: int) -> dict[str, Any]:
    """Round 0 warms both paths (connections, the layout, the destination); rounds 1..n are
    timed: pump, one verified copy (the floor's), then get of a fresh prefix. Returns the
    row of ``remote_get``."""
    nbytes = pages * layout.page_bytes
    verified = VerifiedCopy(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8), layout.page_bytes)
    copies_s: list[float] = []
    get_cpu: dict[str, float] = {}  # CPU seconds over the timed rounds, per process
    floor_cpu: dict[str, float] = {}
    child = (ucx_pump("tcp", "thread", layout.page_bytes, pages, nbytes) if plane == "ucx"
           else tcp_pump(layout.page_bytes, pages, nbytes) if plane == "tcp" else None)  # the child-process pumps
    grpc_pump = GrpcPump(layout.page_bytes, nbytes) if plane == "grpc" else None
    ns = Namespace(model=f"bench-remote-{plane}", revision="r1", layout=layout)
    gets: list[float] = []
    pumps: list[float] = []
    cpu: dict[str, list[float]] = {"sender": [], "receiver": [], "engine": []}  # ms per get
    pump_cpus: list[float] = []  # ms per pump round, all its processes (and this one, the gRPC pump's receiver)
    exact = True
    try:
        async with KVStoreClient(a.address, ns) as on_a, KVStoreClient(c.address, ns) as on_c:
            out: torch.Tensor | None = None
            for r in range(rounds + 1):
                tokens = prefix_tokens(100 + r, pages, layout)
                kv = random_kv(layout, len(tokens), r)
                await on_a.put(tokens, kv)
                await _stored_at(on_c, tokens, 10)
                hit = await on_c.lookup(tokens)
                out = torch.zeros_like(kv) if out is None else out.zero_()
                pump_pid = child.proc.pid if child is not None else grpc_pump.proc.proc.pid  # type: ignore[union-attr]
                pump_meter = Meter({"pump": pump_pid, "engine": OWN}, trees=frozenset({"pump"}))
                pump_meter.start()
                pump = child.round() if child is not None else await grpc_pump.round()  # type: ignore[union-attr]
                pump_cpu = pump_meter.stop()
                copy_meter = Meter({"engine": OWN})
                copy_meter.start()
                t0 = time.perf_counter()
                verified.run()
                copy_s, copy_cpu = time.perf_counter() - t0, copy_meter.stop()
                get_meter = Meter({"sender": a.proc.pid, "receiver": c.proc.pid, "engine": OWN})
                get_meter.start()
                t0 = time.perf_counter()
                await on_c.get(hit, out)
                dt = time.perf_counter() - t0
                used = get_meter.stop()
                exact &= torch.equal(out, kv)
                if r:
                    gets.append(nbytes / dt / 1e9)
                    pumps.append(pump)
                    copies_s.append(copy_s)
                    pump_cpus.append(1000 * sum(pump_cpu.values()))
                    for name, seconds in used.items():
                        cpu[name].append(1000 * seconds)
                    add_cpu(get_cpu, used)
                    add_cpu(floor_cpu, pump_cpu)
                    add_cpu(floor_cpu, copy_cpu)
    finally:
        if child is not None:
            child.close()
        if grpc_pump is not None:
            await grpc_pump.close()
        verified.close()
    ratios = sorted(g / p for g, p in zip(gets, pumps))
    floor_s = [nbytes / p / 1e9 + c for p, c in zip(pumps, copies_s)]  # the pump, then the verified copy
    return {"path": f"remote-get-{plane}", "transport": plane, "floor": f"raw-{plane}-pump+verified-copy",
            "floor_gbps": round(nbytes / statistics.median(floor_s) / 1e9, 3),
            **cpu_fields(nbytes * len(gets), get_cpu, floor_cpu), "gbps": round(statistics.median(gets), 3), "raw_gbps": round(statistics.median(pumps), 3),
            "ratio": round(statistics.median(ratios), 2), "ratio_min": round(ratios[0], 2), "ratio_max": round(ratios[-1], 2),
            "rounds": [{"gbps": round(g, 3), "raw_gbps": round(p, 3)} for g, p in zip(gets, pumps)], "bit_exact": exact,
            "cpu_ms": {name: round(statistics.median(v), 1) for name, v in cpu.items()},
            "pump_cpu_ms": round(statistics.median(pump_cpus), 1)}
