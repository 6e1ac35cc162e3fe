"""kvstore-bench throughput: put/get of 2.25 MiB pages through the client, per data path,
beside the limit each path chases, measured in the same run.

| path | limit |
| --- | --- |
| host-shm-put/get | memcpy of the same bytes, the better of two copies: ordinary stores (torch copy_) and the non-temporal stores the path writes slots with (2 threads, as the client's copy pool) |
| host-grpc-put/get | raw gRPC byte stream of the same size in messages of the same size (bare server, no processing) |
| ssd-put | raw O_DIRECT sequential page writes + fdatasync on the same filesystem |
| ssd-get | raw O_DIRECT page reads of the same bytes |

Beside each rate it reports the CPU the two sides spent per GB moved (this process, plus
the server for a path or the raw gRPC pump for its limit): on a host where client and
server share few cores, a path that needs more CPU per byte than its limit cannot reach
it, whatever the transport does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import grpc
import torch
from tqdm import tqdm

from kvstore import KVLayout, Namespace
from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.bench import limits, rawgrpc
from kvstore.bench.harness import start_raw_grpc, start_server
from kvstore.client import KVStoreClient
from kvstore.wire import CHUNK_BYTES

QWEN3_8B = KVLayout(num_layers=36, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_tokens=16)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=int, default=512, help="pages per batch (512 x 2.25 MiB = 1.125 GiB)")
    p.add_argument("--repeats", type=int, default=5, help="timed pairs (path, then its limit) per path; medians reported")
    p.add_argument("--dir", default="bench-out/throughput", help="work directory (on the filesystem to test)")
    p.add_argument("--paths", default="host-shm,host-grpc,ssd", help="which paths to run")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="the server's --switch-interval-ms, its GIL switch interval (None: the server's default)")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (random bit patterns include NaNs, which never compare equal)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@dataclass(frozen=True)
class Timing:
    """Medians of a path and of its limit over alternating repeats, and the median of the
    per-repeat ratios: each pair is measured back to back, so drift on a shared machine
    (which moved memcpy between 10 and 14 GB/s within an hour here) hits both alike. A limit
    with several ways (memcpy: ordinary and non-temporal stores) counts the fastest way of
    each repeat; ``ways_s`` keeps each way's median.
    ``*_cpu_s``: median CPU seconds of this process plus the peer process (if any)."""

    path_s: float
    limit_s: float
    ratio: float
    path_cpu_s: float = 0.0
    limit_cpu_s: float = 0.0
    ways_s: dict[str, float] = field(default_factory=dict)


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(peer: int | None) -> float:
    """CPU seconds (user + system, all threads) of this process and of ``peer``."""
    own = os.times()
    total = own.user + own.system
    if peer is not None:
        with open(f"/proc/{peer}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return total


async def _timed(fn: Any, limit: Any, repeats: int, setup: Any = None, path_peer: int | None = None,
                 limit_peer: int | None = None) -> Timing:
    """Times ``fn`` and its ``limit`` alternately, ``repeats`` pairs after one warm-up pair.
    ``limit``: one callable, or name -> callable for a limit with several ways (each timed
    in every repeat; the fastest counts). ``setup`` runs untimed before each ``fn``.
    ``*_peer``: the other process whose CPU counts."""
    ways = limit if isinstance(limit, dict) else {"limit": limit}
    path_s, limit_s, path_cpu, limit_cpu = [], [], [], []
    way_s: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(repeats + 1):
        if setup is not None:
            await setup()
        cpu, start = _cpu_s(path_peer), time.perf_counter()
        await fn()
        elapsed, used = time.perf_counter() - start, _cpu_s(path_peer) - cpu
        best = (float("inf"), 0.0)
        for name, way in ways.items():
            cpu, start = _cpu_s(limit_peer), time.perf_counter()
            result = way()
            if asyncio.iscoroutine(result):
                await result
            took = time.perf_counter() - start
            best = min(best, (took, _cpu_s(limit_peer) - cpu))
            if i:
                way_s[name].append(took)
        if i:
            path_s.append(elapsed)
            path_cpu.append(used)
            limit_s.append(best[0])
            limit_cpu.append(best[1])
    return Timing(median(path_s), median(limit_s), median([lim / p for p, lim in zip(path_s, limit_s)]),
                  median(path_cpu), median(limit_cpu), {name: median(xs) for name, xs in way_s.items()} if isinstance(limit, dict) else {})


async def _measure(args: argparse.Namespace, bar: tqdm) -> list[dict[str, Any]]:
    layout = QWEN3_8B
    ns = Namespace(model="Qwen/Qwen3-8B", revision="bench", layout=layout)
    tokens = list(range(args.pages * layout.page_tokens))
    nbytes = args.pages * layout.page_bytes
    kv = torch.empty(layout.num_layers, 2, len(tokens), layout.num_kv_heads, layout.head_dim, dtype=layout.dtype)
    kv.view(torch.int16).random_(-(2**15), 2**15 - 1)
    out = torch.zeros_like(kv)
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    wanted = set(args.paths.split(","))
    results: list[dict[str, Any]] = []

    def add(path: str, timing: Timing, limit: str) -> None:
        gbps, limit_gbps = nbytes / timing.path_s / 1e9, nbytes / timing.limit_s / 1e9
        results.append({"path": path, "gbps": round(gbps, 3), "limit": limit, "limit_gbps": round(limit_gbps, 3),
                        "ratio": round(timing.ratio, 3), "seconds": round(timing.path_s, 4),
                        "cpu_s_per_gb": round(timing.path_cpu_s / (nbytes / 1e9), 3),
                        "limit_cpu_s_per_gb": round(timing.limit_cpu_s / (nbytes / 1e9), 3),
                        **({"limit_ways_gbps": {name: round(nbytes / s / 1e9, 3) for name, s in timing.ways_s.items()}}
                           if timing.ways_s else {})})
        bar.update(1)

    memcpy = limits.Memcpy(kv)
    copies = "memcpy" if len(memcpy.ways()) == 1 else "memcpy(best plain|nt)"  # which copies the limit is the best of
    # No endurance budget here: this measures the data path, not the admission policy.
    server, addr = start_server(workdir, int(nbytes * 1.3) + (64 << 20), int(nbytes * 1.3) + (256 << 20), "--ssd-dwpd", "0",
                                *(() if args.switch_interval_ms is None else ("--switch-interval-ms", str(args.switch_interval_ms))))
    raw_proc, raw_addr = start_raw_grpc()
    server_pid, raw_pid = server.proc.pid, raw_proc.proc.pid
    try:
        async with grpc.aio.insecure_channel(addr) as ch:
            directory = directory_pb2_grpc.DirectoryStub(ch)

            async def clear() -> None:
                await directory.Invalidate(directory_pb2.InvalidateRequest(namespace_id=ns.namespace_id))

            if "host-shm" in wanted:
                async with KVStoreClient(addr, ns) as client:
                    assert client.shared_memory, "benchmark client could not map the arena"
                    add("host-shm-put", await _timed(lambda: client.put(tokens, kv), memcpy.ways(), args.repeats, setup=clear,
                                                     path_peer=server_pid), copies)
                    hit = await client.lookup(tokens)
                    assert hit.num_tokens == len(tokens)
                    timing = await _timed(lambda: client.get(hit, into=out), memcpy.ways(), args.repeats, path_peer=server_pid)
                    assert _same(out, kv), "host-shm get returned other bytes"
                    add("host-shm-get", timing, copies)
            if "host-grpc" in wanted:
                message = min(CHUNK_BYTES, layout.page_bytes)  # the raw pump moves messages of the size ours carry
                async with grpc.aio.insecure_channel(raw_addr, options=rawgrpc.OPTIONS) as raw, \
                        KVStoreClient(addr, ns, use_shm=False) as client:
                    timing = await _timed(lambda: client.put(tokens, kv), lambda: rawgrpc.upload(raw, nbytes, message),
                                          args.repeats, setup=clear, path_peer=server_pid, limit_peer=raw_pid)
                    add("host-grpc-put", timing, "raw-grpc-upload")
                    hit = await client.lookup(tokens)
                    out.zero_()
                    timing = await _timed(lambda: client.get(hit, into=out), lambda: rawgrpc.download(raw, nbytes, message),
                                          args.repeats, path_peer=server_pid, limit_peer=raw_pid)
                    assert _same(out, kv), "host-grpc get returned other bytes"
                    add("host-grpc-get", timing, "raw-grpc-download")
            if "ssd" in wanted:
                disk = limits.RawDisk(workdir / "ssd", kv, layout.page_bytes)
                try:
                    async with KVStoreClient(addr, ns) as client:
                        timing = await _timed(lambda: client.put(tokens, kv, durable=True), disk.write, args.repeats, setup=clear,
                                              path_peer=server_pid)
                        add("ssd-put", timing, "raw-write+sync" + ("" if disk.direct else "(buffered)"))
                        hit = await client.lookup(tokens)

                        async def drop_host() -> None:
                            await directory.Remove(directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=hit.keys, tier="host"))

                        out.zero_()
                        timing = await _timed(lambda: client.get(hit, into=out), disk.read, args.repeats, setup=drop_host,
                                              path_peer=server_pid)
                        assert _same(out, kv), "ssd get returned other bytes"
                        add("ssd-get", timing, "raw-read" + ("-odirect" if disk.direct else ""))
                finally:
                    disk.close()
    finally:
        memcpy.close()
        server.stop()
        raw_proc.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    total = 2 * len(args.paths.split(","))
    with tqdm(total=total, desc="throughput", unit="path", disable=None) as bar:
        results = asyncio.run(_measure(args, bar))
    return {"pages": args.pages, "page_bytes": QWEN3_8B.page_bytes, "results": results}


def print_table(report: dict[str, Any]) -> None:
    print(f"{report['pages']} pages x {report['page_bytes'] / 2**20:.2f} MiB = {report['pages'] * report['page_bytes'] / 2**30:.3f} GiB per batch")
    print(f"{'path':<14} {'GB/s':>7}  {'limit':<22} {'GB/s':>7} {'ratio':>6}   {'CPU s/GB path':>13} {'limit':>6}")
    for r in report["results"]:
        print(f"{r['path']:<14} {r['gbps']:>7.2f}  {r['limit']:<22} {r['limit_gbps']:>7.2f} {r['ratio']:>6.2f}   "
              f"{r['cpu_s_per_gb']:>13.2f} {r['limit_cpu_s_per_gb']:>6.2f}")
        if r.get("limit_ways_gbps"):
            print(f"{'':<24}" + ", ".join(f"{name} {gbps:.2f}" for name, gbps in r["limit_ways_gbps"].items()) + " GB/s")
    print("CPU s/GB: this process plus the server (path) or the raw gRPC pump (limit), per GB moved")
