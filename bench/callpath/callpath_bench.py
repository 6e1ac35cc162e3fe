"""kvstore-bench calls: what a unary call costs on each way ``client.calls`` may take (client/README.md).

One real server (host tier) and one same-host client with the call socket; ``--pages`` pages
stored. Rounds interleave the ways, ``--calls`` calls each; per-call wall times are pooled per
row (median, p90). The question: do the two socket channels beside the runtime's pay (the
issue's bar: > 0.1 ms a call on the engine's path)? Each row is beside the way it would
otherwise take, and a unary gRPC call beside both.

More: bench/callpath/README.md (### callpath_bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kvstore import KVLayout, Namespace
from kvstore._proto import data_pb2, directory_pb2
from kvstore.bench.common.harness import percentile, scratch_dir, start_server
from kvstore.client import KVStoreClient

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=int, default=512, help="pages stored and looked up by the long Lookup")
    p.add_argument("--rounds", type=int, default=8, help="rounds, each every way in turn (one more warms up)")
    p.add_argument("--calls", type=int, default=200, help="calls per way per round")


def _ways(client: KVStoreClient, pages: int) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
    """(from a thread, from the caller's loop): row name -> one call."""
    calls, rt = client.calls, client.runtime
    keys = client.keys(torch.arange(pages * LAYOUT.page_tokens))
    ns = client.namespace.namespace_id
    short = directory_pb2.LookupRequest(namespace_id=ns, keys=keys[:1])
    long = directory_pb2.LookupRequest(namespace_id=ns, keys=keys)
    acquire = data_pb2.AcquireRequest(namespace_id=ns, keys=keys[:1], ttl_ms=30_000)

    def hit(call: Callable[[str, Any], Any]) -> Callable[[], None]:
        def run() -> None:
            lease = call("Data.Acquire", acquire).lease_id
            calls.post("Data.Release", data_pb2.ReleaseRequest(lease_id=lease), 0.2)
        return run

    def on_thread(name: str, request: Any) -> Any:
        return calls.call(name, request, 5.0)

    def via_runtime(name: str, request: Any) -> Any:
        return rt.run(calls.unary(name, request, 5.0), 5.0)

    thread = {"lookup 1 page, thread: blocking channel": lambda: on_thread("Directory.Lookup", short),
              "lookup 1 page, thread: via runtime": lambda: via_runtime("Directory.Lookup", short),
              f"lookup {pages} pages, thread: blocking channel": lambda: on_thread("Directory.Lookup", long),
              f"lookup {pages} pages, thread: via runtime": lambda: via_runtime("Directory.Lookup", long),
              "acquire+release, thread: blocking channel": hit(on_thread),
              "acquire+release, thread: via runtime": hit(via_runtime)}
    loop = {"lookup 1 page, loop: own channel": lambda: calls.unary("Directory.Lookup", short),
            "lookup 1 page, loop: via runtime": lambda: rt.call(calls.unary("Directory.Lookup", short)),
            "lookup 1 page, loop: gRPC": lambda: rt.call(rt.rpc(rt.directory.Lookup, short)),
            f"lookup {pages} pages, loop: own channel": lambda: calls.unary("Directory.Lookup", long),
            f"lookup {pages} pages, loop: via runtime": lambda: rt.call(calls.unary("Directory.Lookup", long)),
            f"lookup {pages} pages, loop: gRPC": lambda: rt.call(rt.rpc(rt.directory.Lookup, long))}
    return thread, loop


async def _measure(args: argparse.Namespace, address: str) -> dict[str, list[float]]:
    async with KVStoreClient(address, Namespace(model="bench-calls", revision="1", layout=LAYOUT)) as client:
        if client.calls.blocking is None:
            raise RuntimeError("the client did not take the call socket: nothing to compare")
        tokens = torch.arange(args.pages * LAYOUT.page_tokens)
        await client.put(tokens, torch.randn(2, 2, len(tokens), 2, 64).to(LAYOUT.dtype))
        thread, loop = _ways(client, args.pages)
        times: dict[str, list[float]] = {name: [] for name in [*thread, *loop]}

        def on_thread(name: str, call: Callable[[], Any]) -> None:
            for _ in range(args.calls):
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)

        for round_ in range(args.rounds + 1):
            for name, call in thread.items():
                worker = threading.Thread(target=on_thread, args=(name, call))
                worker.start()
                await asyncio.to_thread(worker.join)
            for name, coro in loop.items():
                for _ in range(args.calls):
                    start = time.perf_counter()
                    await coro()
                    times[name].append(time.perf_counter() - start)
            if round_ == 0:  # the warm-up round
                for samples in times.values():
                    samples.clear()
        await asyncio.sleep(0.3)  # the posted releases' answers
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    with scratch_dir("kvstore-bench-calls-") as work:
        server, address = start_server(work, 256 << 20, 1 << 30, "--tiers", "host")
        try:
            times = asyncio.run(_measure(args, address))
        finally:
            server.stop()
    rows = [{"way": name, "median_ms": round(percentile(v, 0.5) * 1e3, 4), "p90_ms": round(percentile(v, 0.9) * 1e3, 4),
             "calls": len(v)} for name, v in times.items()]
    return {"pages": args.pages, "rounds": args.rounds, "rows": rows}


def print_table(report: dict[str, Any]) -> None:
    print(f"{'way':<46} {'median ms':>10} {'p90 ms':>8} {'calls':>6}")
    for row in report["rows"]:
        print(f"{row['way']:<46} {row['median_ms']:>10.3f} {row['p90_ms']:>8.3f} {row['calls']:>6}")
