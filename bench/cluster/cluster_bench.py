"""kvstore-bench cluster: cluster mode on loopback (one etcd, kvstore-server nodes as
processes), in one run.

More: bench/cluster/README.md (### cluster_bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvstore import KVLayout, Namespace
from kvstore.bench.cluster.cluster_mooncake import remote_get_gbps
from kvstore.bench.cluster.cluster_paired import paired_rounds
from kvstore.bench.cluster.cluster_paired import prefix_tokens as _tokens
from kvstore.bench.cluster.cluster_paired import random_kv as _kv
from kvstore.bench.cluster.cluster_scale import lookup_rate, plot
from kvstore.bench.common.cluster_procs import Etcd, Node, start_nodes
from kvstore.bench.common.cpu_floor import print_cpu_rows
from kvstore.bench.common.harness import scratch_dir
from kvstore.bench.replay.replay_bench import load_trace
from kvstore.bench.replay.replay_pool import pooled_vs_isolated, print_pool
from kvstore.client import KVStoreClient

BIG = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16, page_tokens=16)  # 2 MiB pages
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)
PHASES = ("get", "lookup", "scaling", "failover", "mooncake", "pool")  # scaling and failover follow lookup's nodes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=int, default=64, help="2 MiB pages per remote get (default 64: 128 MiB)")
    p.add_argument("--rounds", type=int, default=5, help="timed (pump, remote get) pairs per data plane, each get of a fresh prefix")
    p.add_argument("--lookups", type=int, default=300, help="lookups timed for p50/p99")
    p.add_argument("--ttl", type=int, default=10, help="the nodes' --cluster-ttl (failover detection rides on it)")
    p.add_argument("--planes", default="ucx,tcp,grpc", help="data planes of the remote get rows, of ucx,tcp,grpc")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"which parts to run, of {','.join(PHASES)} (e.g. 'get,mooncake': the remote get figures alone)")
    p.add_argument("--scale-seconds", type=float, default=5.0, help="seconds of concurrent lookups per scaling row")
    p.add_argument("--mooncake", choices=["auto", "off"], default="auto", help="measure Mooncake Store's remote get if it imports")
    p.add_argument("--trace", default="tests/data/mooncake_trace_300.jsonl",
                   help="Mooncake-format trace of the pooled vs isolated replay ('' skips it)")
    p.add_argument("--limit-requests", type=int, default=0, help="replay only the first N requests of --trace")
    p.add_argument("--pool-nodes", type=int, default=4, help="engine nodes of the replay (requests round-robin)")
    p.add_argument("--pool-blocks", type=int, default=8192, help="host-tier blocks of the replay, all nodes together")
    p.add_argument("--plot", default="bench-out/cluster.png", help="PNG of the figures ('' for none)")


async def _until(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster did not converge in time")
        await asyncio.sleep(0.02)


async def _found(client: KVStoreClient, tokens: list[int]) -> bool:
    return (await client.lookup(tokens)).num_tokens == len(tokens)


async def _lookups(nodes: list[Node], count: int) -> dict[str, Any]:
    a, c = nodes[0], nodes[-1]
    ns = Namespace(model="bench-lookup", revision="r1", layout=SMALL)
    tokens = _tokens(7, 512, SMALL)
    async with KVStoreClient(a.address, ns) as on_a, KVStoreClient(c.address, ns) as on_c:
        await on_a.put(tokens, _kv(SMALL, len(tokens), 7))
        await _until(lambda: _found(on_c, tokens), 10)
        keys = on_c.keys(tokens)
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            hit = await on_c.lookup_keys(keys)
            times.append(time.perf_counter() - t0)
            assert hit.num_tokens == len(tokens)
    times.sort()
    return {"pages": 512, "owners": len(nodes), "p50_ms": round(1000 * statistics.median(times), 3),
            "p99_ms": round(1000 * times[int(0.99 * (len(times) - 1))], 3)}


async def _failover(nodes: list[Node], ttl_s: int) -> dict[str, Any]:
    b, c = nodes[1], nodes[2]
    ns = Namespace(model="bench-failover", revision="r1", layout=SMALL)
    tokens = _tokens(8, 64, SMALL)
    async with KVStoreClient(b.address, ns) as on_b, KVStoreClient(c.address, ns) as on_c:
        await on_b.put(tokens, _kv(SMALL, len(tokens), 8))
        await _until(lambda: _found(on_c, tokens), 10)
        b.kill()
        killed, worst = time.monotonic(), 0.0
        while time.monotonic() - killed < 3 * ttl_s:
            t0 = time.monotonic()
            hit = await on_c.lookup(tokens)
            worst = max(worst, time.monotonic() - t0)
            if not any(r.node == b.name for r in hit.runs):
                return {"detect_s": round(time.monotonic() - killed, 3), "worst_wait_s": round(worst, 3), "ttl_s": ttl_s}
            await asyncio.sleep(0.02)
    return {"detect_s": None, "worst_wait_s": round(worst, 3), "ttl_s": ttl_s}


def _phases(text: str) -> set[str]:
    phases = {p for p in text.split(",") if p}
    if unknown := phases - set(PHASES):
        raise SystemExit(f"--phases: unknown {','.join(sorted(unknown))} (of {','.join(PHASES)})")
    return phases


def _shards(workdir: Path, etcd: Etcd, args: argparse.Namespace, phases: set[str], report: dict[str, Any]) -> None:
    """Lookup, scaling and failover on one 3-node cluster (5 once two more join)."""
    nodes = start_nodes(workdir, etcd, "shards", ["a", "b", "c"], "ucx", args.ttl, "256MiB")
    try:
        if "lookup" in phases:
            report["lookup"] = asyncio.run(_lookups(nodes, args.lookups))
        if "scaling" in phases:
            report["scaling"] = [asyncio.run(lookup_rate(nodes, args.scale_seconds, SMALL, _tokens, _kv))]
            nodes += start_nodes(workdir, etcd, "shards", ["d", "e"], "ucx", args.ttl, "256MiB")
            report["scaling"].append(asyncio.run(lookup_rate(nodes, args.scale_seconds, SMALL, _tokens, _kv)))
        if "failover" in phases:
            report["failover"] = asyncio.run(_failover(nodes, args.ttl))
    finally:
        for node in nodes:
            node.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    with scratch_dir("kvstore-bench-cluster-") as workdir:
        return _run(args, workdir)


def _run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    phases = _phases(args.phases)
    etcd = Etcd(workdir)
    nbytes = args.pages * BIG.page_bytes
    host = f"{max(512, (args.rounds + 2) * nbytes >> 20)}MiB"  # every prefix of the rounds fits: no eviction mid-bench
    report: dict[str, Any] = {"page_bytes": BIG.page_bytes, "pages": args.pages, "remote_get": [], "phases": sorted(phases),
                              "lookup": None, "scaling": [], "failover": None,
                              "load_average_start": [round(x, 2) for x in os.getloadavg()]}
    try:
        for plane in args.planes.split(",") if "get" in phases else []:
            nodes = start_nodes(workdir, etcd, f"get-{plane}", ["a", "c"], plane, args.ttl, host)
            try:
                report["remote_get"].append(asyncio.run(paired_rounds(plane, nodes[0], nodes[1], BIG, args.pages, args.rounds)))
            finally:
                for node in nodes:
                    node.stop()
        if phases & {"lookup", "scaling", "failover"}:
            _shards(workdir, etcd, args, phases, report)
    finally:
        etcd.stop()
    report["mooncake_remote_gbps"], report["mooncake_skipped"] = (
        remote_get_gbps(workdir, BIG.page_bytes, args.pages, args.rounds) if args.mooncake == "auto" and "mooncake" in phases
        else (None, "--mooncake off" if args.mooncake == "off" else "not in --phases"))
    for row in report["remote_get"]:
        row["over_mooncake"] = round(row["gbps"] / report["mooncake_remote_gbps"], 2) if report["mooncake_remote_gbps"] else None
    report["pooled"] = report["isolated"] = report["pool"] = None
    if args.trace and "pool" in phases:
        reqs = [r.blocks for r in load_trace(args.trace, args.limit_requests)]
        report["pool"] = pooled_vs_isolated(reqs, args.pool_nodes, args.pool_blocks, workdir)
        report["pool"]["trace"] = args.trace
        report["pooled"], report["isolated"] = report["pool"]["pooled"], report["pool"]["isolated"]
    report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.plot and phases == set(PHASES):
        report["plot"] = plot(report, args.plot)
    return report


def print_table(report: dict[str, Any]) -> None:
    print(f"load average {report['load_average_start']} at the start, {report['load_average_end']} at the end")
    mc = report["mooncake_remote_gbps"]
    print(f"remote get: {report['pages']} pages of {report['page_bytes'] >> 20} MiB from node a into an engine on node c; "
          f"Mooncake Store remote TCP get of the same pages: {f'{mc:.2f} GB/s' if mc else report['mooncake_skipped']}")
    print("medians of paired rounds (pump, then get); ratio: median of the per-round ratios, (min-max) beside it")
    print(f"{'data plane':>10} {'GB/s':>7} {'raw pump':>9} {'ratio':>6} {'spread':>11} {'/Mooncake':>9} {'exact':>6} "
          f"{'CPU ms a/c/engine':>18} {'pump CPU ms':>11}")
    for r in report["remote_get"]:
        over = f"{r['over_mooncake']:.2f}" if r["over_mooncake"] else "-"
        spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        print(f"{r['transport']:>10} {r['gbps']:>7.2f} {r['raw_gbps']:>9.2f} {r['ratio']:>6.2f} {spread:>11} {over:>9} "
              f"{r['bit_exact']!s:>6} {'/'.join(f'{v:.0f}' for v in r['cpu_ms'].values()):>18} {r['pump_cpu_ms']:>11.0f}")
    if report["remote_get"]:
        print("CPU seconds per GB got, node a (sender) + node c (receiver) + the engine, beside the floor: the raw pump's\n"
              "processes plus one verified copy (copy + xxh3) into the engine's buffer, in the same rounds")
        print_cpu_rows(report["remote_get"], 16, 30)
    lk, fo = report["lookup"], report["failover"]
    if lk:
        print(f"\nlookup of a {lk['pages']}-page prefix over {lk['owners']} owners: p50 {lk['p50_ms']} ms, p99 {lk['p99_ms']} ms")
    if report["scaling"]:
        print("scaling, one engine per node looking up a 512-page prefix: "
              + ", ".join(f"{s['nodes']} nodes {s['lookups_per_s']} lookups/s ({s['per_node_per_s']}/node)" for s in report["scaling"]))
    if fo:
        print(f"failover (TTL {fo['ttl_s']} s): records of a SIGKILLed node gone from lookups after {fo['detect_s']} s; "
              f"worst lookup wait meanwhile {fo['worst_wait_s']} s\n")
    if report["pool"]:
        print_pool(report["pool"])
    if report.get("plot"):
        print(f"plot: {report['plot']}")
