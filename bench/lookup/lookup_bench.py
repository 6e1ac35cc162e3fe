"""kvstore-bench lookup: how fast the directory answers a 512-page prefix, idle and while
the store demotes to SSD at full speed.

More: bench/lookup/README.md (### lookup_bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median
from typing import Any

import grpc
import torch
from tqdm import tqdm

from kvstore._proto import data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.bench.common.cpu_floor import Meter, ThreadMeter
from kvstore.bench.common.harness import percentile, start_server
from kvstore.bench.lookup import lookup_floor
from kvstore.bench.lookup.lookup_load import LOOKUP_LAYOUT, LOOKUP_NS, WRITER_LAYOUT, WRITER_NS, prefix_tokens
from kvstore.bench.lookup.lookup_procs import Loads, go
from kvstore.bench.lookup.lookup_report import goal_fields, print_table  # noqa: F401 - print_table: kvstore-bench's
from kvstore.client import KVStoreClient
from kvstore.config import DEMOTE_SCHEDS
from kvstore.keys import page_keys

DRAIN_ABOVE = 0.80  # the draining rows' server: demotion starts past this fill of its host tier (well below
# full, so that no allocation of the fill evicts a page itself) ...
DRAIN_TO = 0.05  # ... and writes down nearly all of it
CALLS = {"rpc": "Lookup RPC", "keys": "client.lookup_keys", "client": "client.lookup"}  # a row's "call", by load role
STATES = ("idle", "demoting", "writing", "draining")  # the rows, in the order they run
DEMOTION_THREADS = ("kv-demoter", "kv-verify")  # the server's demoter halves and its verifiers, by their OS names


def _nothing(seconds: float) -> None:
    """No floor window beside a row (more than one client: the floor is one)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=int, default=512, help="pages in the looked-up prefix")
    p.add_argument("--clients", default="1,8", help="client process counts to run")
    p.add_argument("--seconds", type=float, default=5.0, help="measured window per run")
    p.add_argument("--host-capacity", default="256MiB", help="host tier of the server (the writer overflows it)")
    p.add_argument("--ssd-capacity", default="24GiB", help="ssd tier of the server (sparse file)")
    p.add_argument("--demote-sched", default="idle", choices=DEMOTE_SCHEDS,
                   help="the servers' --demote-sched: the background demoter in SCHED_IDLE, or normal at --demote-nice")
    p.add_argument("--demote-nice", type=int, default=10,
                   help="the servers' --demote-nice (0: the demoter competes as an equal, with --demote-sched normal)")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="the servers' --switch-interval-ms, their GIL switch interval (None: the server's default)")
    p.add_argument("--writer-core", type=int, default=-1,
                   help="run the writer alone on this CPU and the server and lookup clients on the others, as an "
                        "engine whose work is not on the store's cores (-1: every process shares every core)")
    p.add_argument("--drain-host-capacity", default="6GiB",
                   help="host tier of the draining rows' server: the backlog they drain (about 0.8 of it; 4 GiB drained "
                        "in under 2 s here once the drain began with the window)")
    p.add_argument("--drain-seconds", type=float, default=2.0,
                   help="measured window of a draining row (it must end before the backlog is written down)")
    p.add_argument("--repeat", type=int, default=1,
                   help="windows of each idle and draining row (a fresh server for each drain), their calls pooled: "
                        "one window's p99 on a noisy 2-core VM moves by 2x from run to run, idle as much as draining")
    p.add_argument("--writer-rate", type=float, default=0.0,
                   help="pages/s of the demoting rows' writer (0: as fast as it can; give a rate to compare two "
                        "builds whose demoters differ in speed at the same write load)")
    p.add_argument("--floor-work-ms", type=float, default=0.3,
                   help="busy work per request of the floor's echo (lookup_floor.py; about a server's share of an idle lookup)")
    p.add_argument("--states", default=",".join(STATES),
                   help="which rows to run (the floor's windows come with the idle and draining ones)")
    p.add_argument("--dir", default="bench-out/lookup", help="work directory")


def _server_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """Flags every server of the run gets, the draining rows' and the control's too."""
    switch = () if args.switch_interval_ms is None else ("--switch-interval-ms", str(args.switch_interval_ms))
    return ("--scrub-rate", "0", "--demote-sched", args.demote_sched, "--demote-nice", str(args.demote_nice), *switch)


def _tier_stats(address: str) -> dict[str, directory_pb2.TierStats]:
    with grpc.insecure_channel(address) as channel:
        stats = directory_pb2_grpc.DirectoryStub(channel).Stats(directory_pb2.StatsRequest(), timeout=30)
    return {t.tier: t for t in stats.tiers}


def _ssd_bytes_in(address: str) -> int:
    ssd = _tier_stats(address).get("ssd")
    return ssd.bytes_in if ssd is not None else 0


def _lease_prefix(address: str, pages: int, seconds: float) -> bytes:
    """Pins the prefix for the run: with no SSD below, the writer would otherwise push it out
    of RAM and the control would time misses."""
    keys = page_keys(LOOKUP_NS.namespace_id, prefix_tokens(pages), LOOKUP_LAYOUT.page_tokens)
    with grpc.insecure_channel(address) as channel:
        answer = data_pb2_grpc.DataStub(channel).Acquire(
            data_pb2.AcquireRequest(namespace_id=LOOKUP_NS.namespace_id, keys=keys, ttl_ms=int((seconds + 120) * 1e3)), timeout=30)
    if len(answer.pages) != pages:
        raise RuntimeError(f"only {len(answer.pages)} of {pages} prefix pages could be leased")
    return answer.lease_id


def _release(address: str, lease_id: bytes) -> None:
    with grpc.insecure_channel(address) as channel:
        data_pb2_grpc.DataStub(channel).Release(data_pb2.ReleaseRequest(lease_id=lease_id), timeout=30)


def _idle(loads: Loads, address: str, server_pid: int, role: str, clients: int, pages: int, seconds: float, repeat: int,
          beside: Callable[[float], None]) -> dict[str, Any]:
    """An idle row: ``repeat`` windows of ``seconds``, their calls pooled, each after one of
    ``beside`` (the floor's); the server's CPU per lookup over them (what a draining row's
    lookups cost the server beside its demoter)."""
    results: list[dict[str, Any]] = []
    meter, cpu_s = Meter({"server": server_pid}, trees=frozenset({"server"})), 0.0
    for _ in range(repeat):
        procs = loads.spawn(role, address, pages, seconds, number=clients)
        beside(seconds)
        meter.start()
        go(procs, time.time() + 0.2)
        results += [loads.collect(p) for p in procs]
        cpu_s += meter.stop()["server"]
    row = _row("idle", role, clients, seconds * repeat, results)
    return {**row, "windows": repeat, "writer_pages": 0, "writer_pages_per_s": 0.0, "demoted_gb_per_s": 0.0,
            "server_cpu_ms_per_lookup": cpu_s / max(1, row["lookups"]) * 1e3}


def _run(loads: Loads, address: str, role: str, clients: int, pages: int, seconds: float, state: str,
         rate: float = 0.0) -> dict[str, Any]:
    """A demoting or writing row: one window beside the writer (idle rows are _idle's)."""
    demote = state == "demoting"
    writer, *procs = loads.spawn(role, address, pages, seconds, number=clients, writer=(seconds + 1.5, rate))
    # leased once every process is ready (starting them can take longer than a lease on a
    # loaded machine), before the writer is let go
    lease = _lease_prefix(address, pages, seconds) if state == "writing" else None
    before = _ssd_bytes_in(address)
    start = time.time() + 0.2
    go([writer], start - 1.0)  # in full swing before the lookups start
    go(procs, start)
    results = [loads.collect(p) for p in procs]
    written = loads.collect(writer)["pages_written"]
    if lease is not None:
        _release(address, lease)
    demoted = _ssd_bytes_in(address) - before
    return {
        **_row(state, role, clients, seconds, results),
        "writer_pages": written, "writer_pages_per_s": written / (seconds + 1.5), "demoted_gb_per_s": demoted / (seconds + 1.5) / 1e9 if demote else 0.0,  # the writer's window
    }


def _row(state: str, role: str, clients: int, seconds: float, results: list[dict[str, Any]]) -> dict[str, Any]:
    latencies = [lat for r in results for lat in r["latencies_s"]]
    paths = sorted({str(r.get("path", "")) for r in results})
    return {
        "state": state, "call": CALLS[role], "path": "+".join(paths),
        "clients": clients, "lookups": len(latencies), "lookups_per_s": len(latencies) / seconds,
        "p50_ms": percentile(latencies, 0.50) * 1e3, "p99_ms": percentile(latencies, 0.99) * 1e3,
        "short_answers": sum(r["short"] for r in results),
        # the clients' own CPU over the window (process_time), per lookup: what a lookup costs the engine's side
        "client_cpu_ms_per_lookup": sum(r.get("cpu_s", 0.0) for r in results) / max(1, len(latencies)) * 1e3,
    }


def _drain(loads: Loads, args: argparse.Namespace, role: str, clients: int, beside: Callable[[float], None]) -> dict[str, Any]:
    """A draining row: ``--repeat`` drains (``_drain_once``), their calls pooled; the GB/s is
    over all their windows, and a window that outlasted its drain is said."""
    drains = [_drain_once(loads, args, role, clients, beside) for _ in range(args.repeat)]
    results = [r for d in drains for r in d["results"]]
    window_s, demoted = sum(d["window_s"] for d in drains), sum(d["demoted"] for d in drains)
    return {**_row("draining", role, clients, args.drain_seconds * args.repeat, results), "windows": args.repeat,
            "writer_pages": 0, "writer_pages_per_s": 0.0, "demoted_gb_per_s": demoted / window_s / 1e9,
            "backlog_gb": min(d["backlog_gb"] for d in drains), "drained_gb": min(d["drained_gb"] for d in drains),
            "window_inside_drain": all(d["inside"] for d in drains),
            # the server's CPU over the windows per GB demoted in them (the demoter's, the lookups' beside it)
            "demoter_cpu_s_per_gb": sum(d["cpu_s"] for d in drains) / (demoted / 1e9) if demoted > 0 else None,
            # the demoter's own threads (kv-demoter*, kv-verify*: named for the OS by the server) per GB demoted
            "demoter_threads_cpu_s_per_gb": sum(d["threads_cpu_s"] for d in drains) / (demoted / 1e9) if demoted > 0 else None,
            "demoted_gb": demoted / 1e9,
            # written to ssd before any window opened (0: every drain began with its window)
            "demoted_before_window_gb": max(d["before"] for d in drains) / 1e9}


def _drain_once(loads: Loads, args: argparse.Namespace, role: str, clients: int, beside: Callable[[float], None]) -> dict[str, Any]:
    """Fills a fresh server's host tier to just below its high watermark, then (after a window
    of ``beside``, the floor's beside dd) puts the page that passes it as the lookups' window
    opens, and times them while the demoter writes the backlog down. Filled past it beforehand, the drain ran unmeasured while the prefix was
    stored and the load processes started: most of the backlog was gone before the window."""
    workdir = Path(args.dir) / "drain"
    shutil.rmtree(workdir, ignore_errors=True)
    server, address = start_server(workdir, args.drain_host_capacity, args.ssd_capacity, "--ssd-dwpd", "0",
                                   "--ssd-admission", "all", *_server_flags(args), "--demote-above", str(DRAIN_ABOVE), "--demote-to", str(DRAIN_TO))
    try:
        host = _tier_stats(address)["host"]
        # the writer puts 16-page batches: it stops a batch or more short of the watermark
        room = int(DRAIN_ABOVE * host.capacity_bytes - host.used_bytes) // WRITER_LAYOUT.page_bytes
        written = 0
        if room // 16 > 1:
            writer = loads.spawn("writer", address, args.pages, 600.0, 0.0, (room // 16 - 1) * 16)[0]
            go([writer], time.time())
            written = loads.collect(writer)["pages_written"]
        # stored after the backlog: the newest pages, demoted last, as in the other rows
        if asyncio.run(_store_prefix(address, args.pages)) != args.pages:
            raise RuntimeError(f"the {args.pages}-page prefix could not be stored whole")
        procs = loads.spawn(role, address, args.pages, args.drain_seconds, number=clients)
        results = []
        try:
            beside(args.drain_seconds)
            crossed, before, t0, t1, after, cpu_s, threads_cpu_s = asyncio.run(_drain_window(address, server.proc.pid, procs, args.drain_seconds))
            results = [loads.collect(p) for p in procs]
        finally:
            if len(results) < len(procs):  # not collected: the window never opened
                for proc in procs:
                    loads.discard(proc)
        written += crossed
        host_end = after["host"]
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"results": results, "demoted": after["ssd"].bytes_in - before, "window_s": t1 - t0, "before": before, "cpu_s": cpu_s,
            "threads_cpu_s": threads_cpu_s,
            "backlog_gb": written * WRITER_LAYOUT.page_bytes / 1e9,
            "drained_gb": after["ssd"].bytes_in / 1e9,  # written to ssd since the (fresh) server started: the drain's
            # still above the low watermark (with a page to spare) when the window ended: the drain outlasted it
            "inside": host_end.used_bytes > DRAIN_TO * host_end.capacity_bytes + WRITER_LAYOUT.page_bytes}


async def _drain_window(address: str, server_pid: int, procs: list[subprocess.Popen[bytes]], seconds: float
                        ) -> tuple[int, int, float, float, dict[str, directory_pb2.TierStats], float, float]:
    """Tops the host tier up to its high watermark without passing it, starts the lookups and
    puts the page that passes it as their window opens. Returns the pages put, the SSD's bytes
    in before that page (0 on a fresh server), the window's start and end and the tiers at its
    end (read there, not once the load processes have exited a second or more later), and the
    server's CPU seconds from that page's put to the window's end, all of it and its demotion
    threads'."""
    kv = torch.randn(WRITER_LAYOUT.num_layers, 2, WRITER_LAYOUT.page_tokens, WRITER_LAYOUT.num_kv_heads,
                     WRITER_LAYOUT.head_dim).to(WRITER_LAYOUT.dtype)
    async with KVStoreClient(address, WRITER_NS) as client:
        used = _tier_stats(address)["host"].used_bytes
        put = await _put_page(client, kv)
        host = _tier_stats(address)["host"]
        step = host.used_bytes - used  # what a page takes of the tier (a slab may round it up)
        if step <= 0:  # else the loop below would never end
            raise RuntimeError("a page put took no room in the host tier")
        while host.used_bytes + step <= DRAIN_ABOVE * host.capacity_bytes:
            put += await _put_page(client, kv)
            host = _tier_stats(address)["host"]
        if host.used_bytes > DRAIN_ABOVE * host.capacity_bytes:
            raise RuntimeError("the host tier passed its high watermark before the window")
        before = _ssd_bytes_in(address)
        start = time.time() + 0.2
        go(procs, start)
        await asyncio.sleep(max(0.0, start - time.time()))
        meter, threads = Meter({"server": server_pid}, trees=frozenset({"server"})), ThreadMeter(server_pid, DEMOTION_THREADS)
        meter.start()
        threads.start()
        put += await _put_page(client, kv)
        await asyncio.sleep(max(0.0, start + seconds - time.time()))
        end, after = time.time(), _tier_stats(address)
        cpu_s, threads_cpu_s = meter.stop()["server"], threads.stop()
    return put, before, start, end, after, cpu_s, threads_cpu_s


async def _put_page(client: KVStoreClient, kv: torch.Tensor) -> int:
    """Puts one page of fresh tokens (a stored page put again is no new page)."""
    base = (1 << 31) + random.randrange(1 << 30)  # apart from the writer process's tokens (below 2**31)
    return await client.put(list(range(base, base + WRITER_LAYOUT.page_tokens)), kv) // WRITER_LAYOUT.page_tokens


async def _store_prefix(address: str, pages: int) -> int:
    tokens = prefix_tokens(pages)
    kv = torch.randn(LOOKUP_LAYOUT.num_layers, 2, len(tokens), 2, 64).to(torch.float16)
    async with KVStoreClient(address, LOOKUP_NS) as client:
        return await client.put(tokens, kv) // LOOKUP_LAYOUT.page_tokens


def _start_together(*starts: Callable[[], Any]) -> list[Any]:
    """The run's servers and the floor's echo, started together before any row (each imports torch: seconds
    one after the other); when one fails or the bench is stopped meanwhile, those that started are stopped."""
    pool = ThreadPoolExecutor(len(starts))
    futures = [pool.submit(start) for start in starts]
    try:
        return [f.result() for f in futures]
    except BaseException:
        for started in (f.result() for f in futures if f.exception() is None):  # waits for those under way
            started[0].stop() if isinstance(started, tuple) else started.close()
        raise
    finally:
        pool.shutdown()


def _hash_ms(pages: int) -> float:
    tokens = prefix_tokens(pages)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        page_keys(LOOKUP_NS.namespace_id, tokens, LOOKUP_LAYOUT.page_tokens)
        times.append(time.perf_counter() - t0)
    return median(times) * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    states = [state for state in STATES if state in args.states.split(",")]
    if not states or set(args.states.split(",")) - set(STATES):
        raise SystemExit(f"--states {args.states}: a comma-separated choice of {', '.join(STATES)}")
    if args.repeat < 1:
        raise SystemExit(f"--repeat {args.repeat}: at least one window per row")
    workdir = Path(args.dir)
    if args.writer_core >= 0:  # this process, hence the server and the clients it starts, off the writer's core
        others = os.sched_getaffinity(0) - {args.writer_core}
        if not others:
            raise SystemExit(f"--writer-core {args.writer_core}: no other CPU is left for the server and clients")
        os.sched_setaffinity(0, others)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    counts = [int(c) for c in args.clients.split(",") if c]
    loads = Loads(max(counts), writer_core=args.writer_core)  # their imports run while the servers start
    try:
        (server, address), (ram_server, ram_address), floor = _start_together(
            lambda: start_server(workdir, args.host_capacity, args.ssd_capacity, "--ssd-dwpd", "0", "--ssd-admission", "all",
                                 *_server_flags(args)),
            lambda: start_server(workdir / "ram", args.host_capacity, args.ssd_capacity, "--tiers", "host", *_server_flags(args)),
            lambda: lookup_floor.Floor(workdir / "floor", args.pages, args.floor_work_ms))
    except BaseException:
        loads.close()
        raise
    plan = [(role, n, state) for state in states for n in counts for role in ("rpc", "keys")]
    plan += [("client", 1, "idle")] if "idle" in states else []
    rows: list[dict[str, Any]] = []
    try:
        for role, n, state in tqdm(plan, desc="lookup runs", file=sys.stderr):
            if state == "draining":  # the floor's windows beside the one-client rows' (the floor is one client)
                rows.append(_drain(loads, args, role, n, floor.writer_window if n == 1 else _nothing))
                continue
            at = ram_address if state == "writing" else address
            # Stored again before each run (only what a previous run's writer pushed out):
            # the prefix is then the newest data in the store and outlives this run's writes.
            stored = asyncio.run(_store_prefix(at, args.pages))
            if stored != args.pages:
                raise RuntimeError(f"only {stored} of {args.pages} prefix pages could be stored")
            # the control writes at the pace the writer reached while demoting, with as many clients
            rate = next((r["writer_pages_per_s"] for r in rows
                         if r["state"] == "demoting" and r["clients"] == n and r["call"] == CALLS[role]), 0.0)
            pace = rate if state == "writing" else args.writer_rate if state == "demoting" else 0.0
            if state == "idle":
                rows.append(_idle(loads, at, server.proc.pid, role, n, args.pages, args.seconds, args.repeat,
                                  floor.idle_window if n == 1 and role != "client" else _nothing))
            else:
                rows.append(_run(loads, at, role, n, args.pages, args.seconds, state, pace))
        rows = floor.rows() + rows
    finally:
        loads.close()
        floor.close()
        server.stop()
        ram_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    goal_fields(rows)
    return {"pages": args.pages, "seconds": args.seconds, "repeat": args.repeat, "demote_sched": args.demote_sched,
            "demote_nice": args.demote_nice,
            "switch_interval_ms": args.switch_interval_ms, "writer_core": args.writer_core, "hash_ms": _hash_ms(args.pages), "rows": rows,
            "num_violations": 0}
