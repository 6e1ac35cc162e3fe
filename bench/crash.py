"""kvstore-bench crash: SIGKILL the real server at random instants during concurrent
durable and RAM-only writes and reads, restart it on the same directories, and check after
every restart:

* every durable put acknowledged before the kill is found whole and bit-exact;
* every RAM-only put is absent, or (where its pages were demoted to SSD before the kill)
  present whole-page and exact: no directory entry without bytes;
* pages of puts in flight at the kill are either absent or bit-exact (never torn);
* no read, during the load or after, ever returns bytes other than the ones written.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvstore import KVLayout, Namespace
from kvstore.bench.harness import start_server
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)
NS = Namespace(model="crash-test", revision="r", layout=LAYOUT)
SERVER_ARGS = ("--ssd-dwpd", "0", "--ssd-admission", "all")
# Large enough that no acknowledged durable page is evicted for room over a few hundred kills:
# the invariants are about crashes, not about capacity eviction (which is legitimate).
SSD_BYTES = 3 << 30


def _tokens(seed: int, pages: int) -> list[int]:
    return [seed * 10_000 + i for i in range(pages * LAYOUT.page_tokens)]


def _kv(seed: int, pages: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.num_layers, 2, pages * LAYOUT.page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g).to(LAYOUT.dtype)


@dataclass
class Model:
    """What the store must hold: seed -> (pages, durable) for acknowledged puts."""

    acked: dict[int, tuple[int, bool]] = field(default_factory=dict)
    in_flight: dict[int, int] = field(default_factory=dict)
    next_seed: int = 1
    epoch_start: int = 1  # first seed written since the last restart
    violations: list[str] = field(default_factory=list)
    reads_verified: int = 0
    pages_checked: int = 0


async def _check_prefix(client: KVStoreClient, seed: int, pages: int, model: Model, mode: str) -> None:
    """mode "durable": must be whole and exact; "restarted": whatever is found must be
    readable and exact (a RAM-only put survives only where its pages were demoted to SSD
    before the kill; an entry without bytes would be a dangling one); "live": during the
    load, found pages may be evicted before the read, but bytes served must be exact."""
    tokens = _tokens(seed, pages)
    hit = await client.lookup(tokens)
    if mode == "durable" and hit.num_tokens != len(tokens):
        model.violations.append(f"seed {seed}: acknowledged durable put has {hit.num_tokens}/{len(tokens)} tokens after restart")
        return
    if hit.num_tokens:
        out = torch.empty(LAYOUT.num_layers, 2, hit.num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype=LAYOUT.dtype)
        try:
            await client.get(hit, into=out)
        except KVStoreError as exc:
            if mode != "live":
                model.violations.append(f"seed {seed}: found after restart but not readable (dangling): {exc}")
            return
        if not torch.equal(out, _kv(seed, pages)[:, :, : hit.num_tokens]):
            model.violations.append(f"seed {seed}: WRONG BYTES served")
        model.pages_checked += hit.num_pages
        model.reads_verified += 1


async def _load(addr: str, model: Model, rng: random.Random, stop: asyncio.Event) -> None:
    async def writer() -> None:
        async with KVStoreClient(addr, NS, timeout_s=5) as client:
            while not stop.is_set():
                seed, pages, durable = model.next_seed, rng.randint(1, 12), rng.random() < 0.6
                model.next_seed += 1
                model.in_flight[seed] = pages
                try:
                    await client.put(_tokens(seed, pages), _kv(seed, pages), durable=durable)
                except KVStoreError:
                    return
                del model.in_flight[seed]
                model.acked[seed] = (pages, durable)

    async def reader() -> None:
        async with KVStoreClient(addr, NS, timeout_s=5) as client:
            while not stop.is_set():
                if not model.acked:
                    await asyncio.sleep(0.01)
                    continue
                seed = rng.choice(list(model.acked))
                try:
                    await _check_prefix(client, seed, model.acked[seed][0], model, "live")
                except KVStoreError:
                    return

    await asyncio.gather(writer(), writer(), reader(), return_exceptions=True)


async def run_iterations(workdir: Path, iterations: int, seed: int, bar: Any = None) -> dict[str, Any]:
    rng = random.Random(seed)
    model = Model()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    restarts: list[float] = []
    server = None
    try:
        for it in range(iterations):
            t0 = time.perf_counter()
            server, addr = start_server(workdir, 32 << 20, SSD_BYTES, *SERVER_ARGS)
            restarts.append(time.perf_counter() - t0)
            async with KVStoreClient(addr, NS, timeout_s=10) as client:
                # Everything acknowledged since the last kill, every in-flight put, and (to stay
                # bounded over hundreds of kills) a sample of older ones; all of them every 10th.
                fresh = {s: v for s, v in model.acked.items() if s >= model.epoch_start}
                older = [s for s in model.acked if s < model.epoch_start]
                sample = older if it % 10 == 0 else rng.sample(older, min(len(older), 64))
                for s in list(fresh) + sample:
                    pages, durable = model.acked[s]
                    await _check_prefix(client, s, pages, model, "durable" if durable else "restarted")
                for s, pages in list(model.in_flight.items()):
                    await _check_prefix(client, s, pages, model, "restarted")
            model.epoch_start = model.next_seed
            # RAM-only pages are gone for good after a restart; in-flight ones are settled.
            model.acked = {s: v for s, v in model.acked.items() if v[1]}
            model.in_flight.clear()
            stop = asyncio.Event()
            load = asyncio.ensure_future(_load(addr, model, rng, stop))
            await asyncio.sleep(rng.uniform(0.2, 1.0))
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(10)
            stop.set()
            await asyncio.wait_for(load, 30)
            if bar is not None:
                bar.update(1)
        # a last restart to check the final kill
        server, addr = start_server(workdir, 32 << 20, SSD_BYTES, *SERVER_ARGS)
        async with KVStoreClient(addr, NS, timeout_s=10) as client:
            for s, (pages, durable) in list(model.acked.items()):
                await _check_prefix(client, s, pages, model, "durable" if durable else "restarted")
        server.stop()
    finally:
        if server is not None and server.proc.poll() is None:
            server.proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    durable = sum(1 for v in model.acked.values() if v[1])
    return {
        "iterations": iterations, "puts": model.next_seed - 1, "durable_puts_alive": durable,
        "reads_verified": model.reads_verified, "pages_checked": model.pages_checked,
        "violations": model.violations[:20], "num_violations": len(model.violations),
        "restart_s_median": sorted(restarts)[len(restarts) // 2], "restart_s_max": max(restarts),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default="bench-out/crash")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tqdm(total=args.iterations, desc="crash", unit="kill", disable=None) as bar:
        return asyncio.run(run_iterations(Path(args.dir), args.iterations, args.seed, bar))


def print_table(report: dict[str, Any]) -> None:
    for key in ("iterations", "puts", "durable_puts_alive", "reads_verified", "pages_checked", "num_violations",
                "restart_s_median", "restart_s_max"):
        print(f"{key:>20}: {report[key]}")
    for v in report["violations"]:
        print(f"  VIOLATION {v}")
