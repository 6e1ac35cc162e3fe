"""kvstore-bench crash: SIGKILL the real server at random instants during concurrent
durable and RAM-only writes and reads, restart it on the same directories, and check after
every restart.

More: bench/durability/README.md (### crash.py).
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
from kvstore.bench.common.harness import KILL_WAIT_S, start_server
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError, PageMissing
from kvstore.keys import page_keys

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)
NS = Namespace(model="crash-test", revision="r", layout=LAYOUT)
SERVER_ARGS = ("--ssd-dwpd", "0", "--ssd-admission", "all")
# Large enough that no acknowledged durable page is evicted for room over a few hundred kills:
# the invariants are about crashes, not about capacity eviction (which is legitimate).
SSD_BYTES = 3 << 30
MAX_PAGES = 12


def _kv(tokens: list[int]) -> torch.Tensor:
    """The KV of ``tokens``' full pages: each page's bytes are seeded by its key."""
    pages = []
    for key in page_keys(NS.namespace_id, tokens, LAYOUT.page_tokens):
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
        pages.append(torch.randn(LAYOUT.num_layers, 2, LAYOUT.page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g))
    return torch.cat(pages, dim=2).to(LAYOUT.dtype)


@dataclass
class Model:
    """What the store must hold: seed -> (tokens, durable) for acknowledged puts."""

    acked: dict[int, tuple[list[int], bool]] = field(default_factory=dict)
    in_flight: dict[int, list[int]] = field(default_factory=dict)
    next_seed: int = 1
    next_token: int = 0  # new pages take fresh token ids from here
    epoch_start: int = 1  # first seed written since the last restart
    killed: bool = False  # set before the SIGKILL: errors after it are expected
    violations: list[str] = field(default_factory=list)
    reads_verified: int = 0
    pages_checked: int = 0
    shared_prefix_puts: int = 0  # puts whose leading pages an earlier put stored
    durable_over_ram: int = 0  # durable puts over a prefix put RAM-only
    live_misses: int = 0  # pages evicted between a live lookup and its read (allowed)

    def new_sequence(self, rng: random.Random) -> tuple[list[int], bool]:
        """Fresh pages, or some leading pages of an earlier sequence and fresh ones after."""
        tokens: list[int] = []
        earlier = list(self.acked.items()) + [(s, (t, False)) for s, t in self.in_flight.items()]
        recent = [e for e in earlier if e[0] >= self.epoch_start]  # RAM-only ones are still in RAM
        if earlier and rng.random() < 0.6:
            _, (base, base_durable) = rng.choice(recent if recent and rng.random() < 0.7 else earlier)
            shared = rng.randint(1, len(base) // LAYOUT.page_tokens)
            tokens = base[: shared * LAYOUT.page_tokens]
            durable = rng.random() < 0.6
            self.shared_prefix_puts += 1
            self.durable_over_ram += int(durable and not base_durable)
        else:
            durable = rng.random() < 0.6
        new_pages = rng.randint(0 if tokens else 1, MAX_PAGES - len(tokens) // LAYOUT.page_tokens)
        tokens = tokens + list(range(self.next_token, self.next_token + new_pages * LAYOUT.page_tokens))
        self.next_token += new_pages * LAYOUT.page_tokens
        return tokens, durable

    def unexpected(self, who: str, exc: BaseException) -> None:
        """Records an error that ended a writer or the reader as a violation, unless it is
        the connection failing after the kill (a plain KVStoreError: the server is gone)."""
        if not (self.killed and type(exc) is KVStoreError):
            state = "after the kill" if self.killed else "while the server was up"
            self.violations.append(f"{who}: {type(exc).__name__} {state}: {exc}")


async def _check_prefix(client: KVStoreClient, seed: int, tokens: list[int], model: Model, mode: str) -> None:
    """mode "durable": must be whole and exact; "restarted": whatever is found must be
    readable and exact (a RAM-only put survives only where its pages reached SSD before the
    kill; an entry without bytes would be a dangling one); "live": during the load, found
    pages may be evicted before the read (PageMissing), but bytes served must be exact."""
    hit = await client.lookup(tokens)
    if mode == "durable" and hit.num_tokens != len(tokens):
        model.violations.append(f"seed {seed}: acknowledged durable put has {hit.num_tokens}/{len(tokens)} tokens after restart")
        return
    if not hit.num_tokens:
        return
    out = torch.empty(LAYOUT.num_layers, 2, hit.num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    try:
        await client.get(hit, into=out)
    except PageMissing:
        if mode != "live":
            raise
        model.live_misses += 1
        return
    if not torch.equal(out, _kv(tokens)[:, :, : hit.num_tokens]):
        model.violations.append(f"seed {seed}: WRONG BYTES served")
    model.pages_checked += hit.num_pages
    model.reads_verified += 1


async def _load(addr: str, model: Model, rng: random.Random, stop: asyncio.Event) -> None:
    async def writer() -> None:
        async with KVStoreClient(addr, NS, timeout_s=5) as client:
            while not stop.is_set():
                seed = model.next_seed
                tokens, durable = model.new_sequence(rng)
                model.next_seed += 1
                model.in_flight[seed] = tokens
                try:
                    stored = await client.put(tokens, _kv(tokens), durable=durable)
                except KVStoreError as exc:
                    model.unexpected(f"put of seed {seed}", exc)
                    return
                del model.in_flight[seed]
                if stored != len(tokens):
                    model.violations.append(f"seed {seed}: put stored {stored} of {len(tokens)} tokens without an error")
                model.acked[seed] = (tokens, durable)

    async def reader() -> None:
        async with KVStoreClient(addr, NS, timeout_s=5) as client:
            while not stop.is_set():
                if not model.acked:
                    await asyncio.sleep(0.01)
                    continue
                seed = rng.choice(list(model.acked))
                try:
                    await _check_prefix(client, seed, model.acked[seed][0], model, "live")
                except KVStoreError as exc:
                    model.unexpected(f"read of seed {seed}", exc)
                    return

    for result in await asyncio.gather(writer(), writer(), reader(), return_exceptions=True):
        if isinstance(result, BaseException):  # a client could not connect or close, or a bug in the load
            model.unexpected("load", result)


async def _check_after_restart(client: KVStoreClient, seed: int, tokens: list[int], model: Model, mode: str) -> None:
    try:
        await _check_prefix(client, seed, tokens, model, mode)
    except KVStoreError as exc:
        model.violations.append(f"seed {seed}: found after restart but not readable (dangling): {exc}")


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
                    tokens, durable = model.acked[s]
                    await _check_after_restart(client, s, tokens, model, "durable" if durable else "restarted")
                for s, tokens in list(model.in_flight.items()):
                    await _check_after_restart(client, s, tokens, model, "restarted")
            model.epoch_start = model.next_seed
            # RAM-only pages are gone for good after a restart; in-flight ones are settled.
            model.acked = {s: v for s, v in model.acked.items() if v[1]}
            model.in_flight.clear()
            stop = asyncio.Event()
            model.killed = False
            load = asyncio.ensure_future(_load(addr, model, rng, stop))
            await asyncio.sleep(rng.uniform(0.2, 1.0))
            model.killed = True
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(KILL_WAIT_S)
            stop.set()
            await asyncio.wait_for(load, 30)
            if bar is not None:
                bar.update(1)
        # a last restart to check the final kill
        server, addr = start_server(workdir, 32 << 20, SSD_BYTES, *SERVER_ARGS)
        async with KVStoreClient(addr, NS, timeout_s=10) as client:
            for s, (tokens, durable) in list(model.acked.items()):
                await _check_after_restart(client, s, tokens, model, "durable" if durable else "restarted")
        server.stop()
    finally:
        if server is not None and server.proc.poll() is None:
            server.proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    alive = sum(1 for _, durable in model.acked.values() if durable)
    return {
        "iterations": iterations, "puts": model.next_seed - 1, "durable_puts_alive": alive,
        "reads_verified": model.reads_verified, "pages_checked": model.pages_checked,
        "shared_prefix_puts": model.shared_prefix_puts, "durable_over_ram": model.durable_over_ram,
        "live_misses": model.live_misses,
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
    for key in ("iterations", "puts", "shared_prefix_puts", "durable_over_ram", "durable_puts_alive", "reads_verified",
                "pages_checked", "live_misses", "num_violations", "restart_s_median", "restart_s_max"):
        print(f"{key:>20}: {report[key]}")
    for v in report["violations"]:
        print(f"  VIOLATION {v}")
