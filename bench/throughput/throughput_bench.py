"""kvstore-bench throughput: put/get of 2.25 MiB pages through the client, per data path,
beside the limit each path chases, measured in the same run.

More: bench/throughput/README.md (### throughput_bench.py).
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
from kvstore.bench.common import limits, rawgrpc
from kvstore.bench.common.cpu_floor import OWN, HashPass, Meter, VerifiedCopy, add_cpu, cpu_fields, print_cpu_rows
from kvstore.bench.common.harness import start_raw_grpc, start_server
from kvstore.client import KVStoreClient
from kvstore.page_wire.grpc_chunks import CHUNK_BYTES

SHM_FLOOR = "memcpy+xxh3(best apart|fused)"
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
    """Medians of a path, its limit and its floor over alternating repeats, and the median of
    the per-repeat ratios path/limit: each set is measured back to back, so drift on a shared
    machine (which moved memcpy between 10 and 14 GB/s within an hour here) hits them alike.
    A limit or floor with several ways (memcpy: ordinary and non-temporal stores) counts the
    fastest way of each repeat; ``ways_s`` keeps each limit way's median.
    ``*_cpu``: CPU seconds per process summed over the timed repeats (the floor's: of its
    leanest way in each repeat)."""

    path_s: float
    limit_s: float
    ratio: float
    floor_s: float
    path_cpu: dict[str, float]
    limit_cpu: dict[str, float]
    floor_cpu: dict[str, float]
    ways_s: dict[str, float] = field(default_factory=dict)
    passes_cpu: dict[str, float] = field(default_factory=dict)  # the ``passes`` way's, when measured


async def _call(fn: Any) -> None:
    """Calls ``fn``, plain or async."""
    result = fn()
    if asyncio.iscoroutine(result):
        await result


async def _once(fn: Any, meter: Meter) -> tuple[float, dict[str, float]]:
    """Wall seconds and CPU seconds per process of one call of ``fn`` (plain or async)."""
    meter.start()
    start = time.perf_counter()
    await _call(fn)
    return time.perf_counter() - start, meter.stop()


def _then(*steps: Any) -> Any:
    """One floor way: ``steps`` (plain or async) one after another."""
    async def run() -> None:
        for step in steps:
            await _call(step)
    return run


async def _timed(fn: Any, limit: Any, floor: dict[str, Any], repeats: int, setup: Any = None,
                 path_pids: dict[str, int] | None = None, limit_pids: dict[str, int] | None = None,
                 passes: Any = None) -> Timing:
    """Times ``fn``, its ``limit`` and its ``floor`` (name -> way: the raw transport plus the
    one copy/hash checking its bytes costs) in turn, ``repeats`` sets after one warm-up set.
    ``limit``: one callable, or name -> callable for a limit with several ways. ``setup``
    runs untimed before each ``fn``. ``path_pids``/``limit_pids``: the processes whose CPU
    counts (the floor runs on the limit's). ``passes``: a way doing, on the raw parts, every pass
    the path's design cannot leave out (README: the SSD rows), timed beside them."""
    ways = limit if isinstance(limit, dict) else {"limit": limit}
    path_meter = Meter(path_pids or {"client": OWN})
    limit_meter = Meter(limit_pids or {"client": OWN})
    path_s, limit_s, floor_s, ratios = [], [], [], []
    path_cpu: dict[str, float] = {}
    limit_cpu: dict[str, float] = {}
    floor_cpu: dict[str, float] = {}
    passes_cpu: dict[str, float] = {}
    way_s: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(repeats + 1):
        if setup is not None:
            await setup()
        took, used = await _once(fn, path_meter)
        limits = {name: await _once(way, limit_meter) for name, way in ways.items()}
        floors = [await _once(way, limit_meter) for way in floor.values()]
        designed = await _once(passes, limit_meter) if passes is not None else None
        if not i:
            continue
        fastest = min(limits.values(), key=lambda r: r[0])
        path_s.append(took)
        limit_s.append(fastest[0])
        ratios.append(fastest[0] / took)
        floor_s.append(min(f[0] for f in floors))
        add_cpu(path_cpu, used)
        add_cpu(limit_cpu, fastest[1])
        add_cpu(floor_cpu, min(floors, key=lambda f: sum(f[1].values()))[1])
        if designed is not None:
            add_cpu(passes_cpu, designed[1])
        for name, (way_took, _) in limits.items():
            way_s[name].append(way_took)
    return Timing(median(path_s), median(limit_s), median(ratios), median(floor_s), path_cpu, limit_cpu, floor_cpu,
                  {name: median(xs) for name, xs in way_s.items()} if isinstance(limit, dict) else {}, passes_cpu)


def _passes_fields(name: str, timing: Timing, moved: int) -> dict[str, Any]:
    """The row's design floor (``passes``): its CPU per GB and the path's over it."""
    path, passes = sum(timing.path_cpu.values()) / (moved / 1e9), sum(timing.passes_cpu.values()) / (moved / 1e9)
    return {"passes": name, "passes_cpu_s_per_gb": round(passes, 4),
            "passes_cpu_ratio": round(path / passes, 3) if passes > 0 else None}


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

    def add(path: str, timing: Timing, limit: str, floor: str, passes: str = "") -> None:
        gbps, limit_gbps = nbytes / timing.path_s / 1e9, nbytes / timing.limit_s / 1e9
        moved = nbytes * args.repeats
        results.append({"path": path, "gbps": round(gbps, 3), "limit": limit, "limit_gbps": round(limit_gbps, 3),
                        "ratio": round(timing.ratio, 3), "seconds": round(timing.path_s, 4),
                        "floor": floor, "floor_gbps": round(nbytes / timing.floor_s / 1e9, 3),
                        **cpu_fields(moved, timing.path_cpu, timing.floor_cpu),
                        "limit_cpu_s_per_gb": round(sum(timing.limit_cpu.values()) / (moved / 1e9), 4),
                        **({"limit_ways_gbps": {name: round(nbytes / s / 1e9, 3) for name, s in timing.ways_s.items()}}
                           if timing.ways_s else {}),
                        **(_passes_fields(passes, timing, moved) if passes else {})})
        bar.update(1)

    memcpy = limits.Memcpy(kv)
    kv_bytes = kv.view(torch.uint8).reshape(-1).numpy()
    # The floors' one verified copy / one hash pass (into memcpy's destination: no third buffer of the batch's size).
    verified = VerifiedCopy(kv_bytes, layout.page_bytes, dst=memcpy.dst.view(torch.uint8).reshape(-1).numpy())
    hashed = HashPass(memcpy.dst.view(torch.uint8).reshape(-1).numpy(), layout.page_bytes)
    # shm floor: memcpy plus one xxh3 pass, done apart or fused (the leaner counts: SHM_FLOOR)
    shm_floor = {"memcpy+xxh3": _then(memcpy.plain, hashed.run), "copy-xxh3-fused": verified.run}
    copies = "memcpy" if len(memcpy.ways()) == 1 else "memcpy(best plain|nt)"  # which copies the limit is the best of
    # No endurance budget here: this measures the data path, not the admission policy.
    server, addr = start_server(workdir, int(nbytes * 1.3) + (64 << 20), int(nbytes * 1.3) + (256 << 20), "--ssd-dwpd", "0",
                                *(() if args.switch_interval_ms is None else ("--switch-interval-ms", str(args.switch_interval_ms))))
    raw_proc, raw_addr = start_raw_grpc()
    path_pids = {"client": OWN, "server": server.proc.pid}
    raw_pids = {"client": OWN, "raw-grpc": raw_proc.proc.pid}
    try:
        async with grpc.aio.insecure_channel(addr) as ch:
            directory = directory_pb2_grpc.DirectoryStub(ch)

            async def clear() -> None:
                await directory.Invalidate(directory_pb2.InvalidateRequest(namespace_id=ns.namespace_id))

            if "host-shm" in wanted:
                async with KVStoreClient(addr, ns) as client:
                    assert client.shared_memory, "benchmark client could not map the arena"
                    add("host-shm-put", await _timed(lambda: client.put(tokens, kv), memcpy.ways(), shm_floor, args.repeats,
                                                     setup=clear, path_pids=path_pids), copies, SHM_FLOOR)
                    hit = await client.lookup(tokens)
                    assert hit.num_tokens == len(tokens)
                    timing = await _timed(lambda: client.get(hit, into=out), memcpy.ways(), shm_floor, args.repeats,
                                          path_pids=path_pids)
                    assert _same(out, kv), "host-shm get returned other bytes"
                    add("host-shm-get", timing, copies, SHM_FLOOR)
            if "host-grpc" in wanted:
                message = min(CHUNK_BYTES, layout.page_bytes)  # the raw pump moves messages of the size ours carry
                async with grpc.aio.insecure_channel(raw_addr, options=rawgrpc.OPTIONS) as raw, \
                        KVStoreClient(addr, ns, use_shm=False) as client:
                    upload = lambda: rawgrpc.upload(raw, nbytes, message)
                    timing = await _timed(lambda: client.put(tokens, kv), upload, {"up": _then(upload, verified.run)},
                                          args.repeats, setup=clear, path_pids=path_pids, limit_pids=raw_pids)
                    add("host-grpc-put", timing, "raw-grpc-upload", "raw-grpc-upload+verified-copy")
                    hit = await client.lookup(tokens)
                    out.zero_()
                    download = lambda: rawgrpc.download(raw, nbytes, message)
                    timing = await _timed(lambda: client.get(hit, into=out), download, {"down": _then(download, verified.run)},
                                          args.repeats, path_pids=path_pids, limit_pids=raw_pids)
                    assert _same(out, kv), "host-grpc get returned other bytes"
                    add("host-grpc-get", timing, "raw-grpc-download", "raw-grpc-download+verified-copy")
            if "ssd" in wanted:
                disk = limits.RawDisk(workdir / "ssd", kv, layout.page_bytes)
                disk_hash = HashPass(disk.buf, layout.page_bytes)
                try:
                    async with KVStoreClient(addr, ns) as client:
                        # the passes a put to SSD cannot leave out: the engine's bytes copied into the shared
                        # arena, hashed at their source as they go; the server's check of the slot (the
                        # client can still write it) before it goes to disk; the write
                        timing = await _timed(lambda: client.put(tokens, kv, durable=True), disk.write,
                                              {"write": _then(disk_hash.run, disk.write)}, args.repeats, setup=clear,
                                              path_pids=path_pids, passes=_then(verified.run, disk_hash.run, disk.write))
                        raw_write = "raw-write+sync" + ("" if disk.direct else "(buffered)")
                        add("ssd-put", timing, raw_write, "xxh3+" + raw_write, "copy-xxh3+xxh3+" + raw_write)
                        hit = await client.lookup(tokens)

                        async def drop_host() -> None:
                            await directory.Remove(directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=hit.keys, tier="host"))

                        out.zero_()
                        # cannot leave out: the read into the arena, the verified copy out of it into the engine's buffer
                        timing = await _timed(lambda: client.get(hit, into=out), disk.read, {"read": _then(disk.read, disk_hash.run)},
                                              args.repeats, setup=drop_host, path_pids=path_pids,
                                              passes=_then(disk.read, verified.run))
                        assert _same(out, kv), "ssd get returned other bytes"
                        raw_read = "raw-read" + ("-odirect" if disk.direct else "")
                        add("ssd-get", timing, raw_read, raw_read + "+xxh3", raw_read + "+copy-xxh3")
                finally:
                    disk_hash.close()
                    disk.close()
    finally:
        memcpy.close()
        verified.close()
        hashed.close()
        server.stop()
        raw_proc.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    total = 2 * len(args.paths.split(","))
    load_start = [round(x, 2) for x in os.getloadavg()]  # CPU per GB also grows on a busy host (shared caches, SMT)
    with tqdm(total=total, desc="throughput", unit="path", disable=None) as bar:
        results = asyncio.run(_measure(args, bar))
    return {"pages": args.pages, "page_bytes": QWEN3_8B.page_bytes, "results": results,
            "load_average_start": load_start, "load_average_end": [round(x, 2) for x in os.getloadavg()]}


def print_table(report: dict[str, Any]) -> None:
    print(f"{report['pages']} pages x {report['page_bytes'] / 2**20:.2f} MiB = {report['pages'] * report['page_bytes'] / 2**30:.3f} GiB per batch"
          f"; load average {report['load_average_start']} at the start, {report['load_average_end']} at the end")
    print(f"{'path':<14} {'GB/s':>7}  {'limit':<22} {'GB/s':>7} {'ratio':>6}   {'CPU s/GB':>8} {'limit':>6}")
    for r in report["results"]:
        print(f"{r['path']:<14} {r['gbps']:>7.2f}  {r['limit']:<22} {r['limit_gbps']:>7.2f} {r['ratio']:>6.2f}   "
              f"{r['cpu_s_per_gb']:>8.3f} {r['limit_cpu_s_per_gb']:>6.3f}")
        if r.get("limit_ways_gbps"):
            print(f"{'':<24}" + ", ".join(f"{name} {gbps:.2f}" for name, gbps in r["limit_ways_gbps"].items()) + " GB/s")
    print("\nCPU seconds per GB moved, every process (client: this process; server; raw-grpc: the bare pump), beside the floor:"
          "\nthe limit's transport plus the one copy and/or xxh3 pass checking the bytes costs, in the same run")
    print_cpu_rows(report["results"], 14, 34)
    passes = [r for r in report["results"] if r.get("passes")]
    if passes:
        print("\nBeside the passes the path's design cannot leave out (done on the raw parts, in the same run):")
        for r in passes:
            ratio = f"{r['passes_cpu_ratio']:.2f}" if r["passes_cpu_ratio"] is not None else "-"
            print(f"{r['path']:<14} {r['cpu_s_per_gb']:>8.3f}  {r['passes']:<40} {r['passes_cpu_s_per_gb']:>8.3f} {ratio:>6}")
