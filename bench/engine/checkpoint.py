"""kvstore-bench checkpoint: the trade-off of the KV checkpoint policies of a session —
bytes written to SSD vs tokens to prefill again after a crash — measured through the real
store: a session of P prompt tokens generating G tokens checkpoints after every step by
policy; a crash at each of K instants is evaluated with the real restart recovery (what is
durable is what ``recover`` finds after the server is killed and restarted)."""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import grpc
import torch
from tqdm import tqdm

from kvstore import KVLayout, Namespace
from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.bench.common.harness import KILL_WAIT_S, start_server
from kvstore.client import KVStoreClient

LAYOUT = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--generate", type=int, default=1024)
    p.add_argument("--crashes", type=int, default=4, help="crash instants evaluated per policy")
    p.add_argument("--periods", default="64,256", help="checkpoint_tokens for the periodic policy")
    p.add_argument("--dir", default="bench-out/checkpoint")


async def _one(workdir: Path, policy: str, period: int, prompt: int, generate: int, crash_at: int, kv: torch.Tensor) -> dict[str, Any]:
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    args = ("--ssd-dwpd", "0", "--ssd-admission", "all", "--metrics-listen", "off")
    server, addr = start_server(workdir, 256 << 20, 512 << 20, *args)
    ns = Namespace(model="checkpoint-bench", revision="r", layout=LAYOUT)
    tokens = list(range(prompt + generate))
    try:
        async with KVStoreClient(addr, ns) as client:
            session = client.session("s", sync_every=1, checkpoint=policy, checkpoint_tokens=period)
            await session.start(tokens[:prompt])
            await session.checkpoint(tokens[:prompt], kv, force=True)
            for step in range(1, crash_at + 1):
                await session.returned([tokens[prompt + step - 1]])
                await session.checkpoint(tokens[: prompt + step], kv)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(KILL_WAIT_S)
        server, addr = start_server(workdir, 256 << 20, 512 << 20, *args)
        async with KVStoreClient(addr, ns) as client:
            rec = await client.recover("s")
            assert rec is not None
        with grpc.insecure_channel(addr) as ch:
            stats = directory_pb2_grpc.DirectoryStub(ch).Stats(directory_pb2.StatsRequest(), timeout=10)
        ssd_pages = sum(t.num_pages for t in stats.tiers if t.tier == "ssd")
    finally:
        server.stop()
    return {"policy": policy if policy != "periodic" else f"periodic-{period}", "crash_at": crash_at,
            "returned": len(rec.returned), "stored_tokens": rec.stored_tokens, "to_prefill": len(rec.to_prefill),
            "ssd_bytes_written": ssd_pages * LAYOUT.page_bytes}


async def _measure(args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    total = args.prompt + args.generate
    kv = torch.randn(LAYOUT.num_layers, 2, total, LAYOUT.num_kv_heads, LAYOUT.head_dim).to(LAYOUT.dtype)
    rng = random.Random(0)
    instants = sorted(rng.randint(1, args.generate) for _ in range(args.crashes))
    policies = [("ram", 0), ("write-through", 0)] + [("periodic", int(p)) for p in args.periods.split(",")]
    rows = []
    for policy, period in policies:
        for crash_at in instants:
            rows.append(await _one(Path(args.dir), policy, period, args.prompt, args.generate, crash_at, kv))
            bar.update(1)
    shutil.rmtree(args.dir, ignore_errors=True)
    summary = {}
    for row in rows:
        s = summary.setdefault(row["policy"], {"ssd_mib_per_1k_tokens": [], "to_prefill": []})
        s["ssd_mib_per_1k_tokens"].append(row["ssd_bytes_written"] / 2**20 / ((args.prompt + row["crash_at"]) / 1000))
        s["to_prefill"].append(row["to_prefill"])
    results = [{"policy": k, "ssd_mib_per_1k_tokens": round(sum(v["ssd_mib_per_1k_tokens"]) / len(v["ssd_mib_per_1k_tokens"]), 2),
                "mean_tokens_to_prefill": round(sum(v["to_prefill"]) / len(v["to_prefill"]), 1)} for k, v in summary.items()]
    return {"prompt": args.prompt, "generate": args.generate, "crash_instants": instants,
            "bytes_per_token": LAYOUT.bytes_per_token, "results": results, "runs": rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    steps = (2 + len(args.periods.split(","))) * args.crashes
    with tqdm(total=steps, desc="checkpoint", unit="crash", disable=None) as bar:
        return asyncio.run(_measure(args, bar))


def print_table(report: dict[str, Any]) -> None:
    print(f"prompt {report['prompt']} + up to {report['generate']} generated tokens, crashes after {report['crash_instants']} tokens; "
          f"KV {report['bytes_per_token'] / 1024:.0f} KiB/token")
    print(f"{'policy':<16} {'SSD MiB / 1k tokens':>20} {'tokens to prefill after crash':>30}")
    for r in report["results"]:
        print(f"{r['policy']:<16} {r['ssd_mib_per_1k_tokens']:>20.2f} {r['mean_tokens_to_prefill']:>30.1f}")
