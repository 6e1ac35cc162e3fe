"""Load processes for ``kvstore-bench lookup``: one per lookup client, one writer.

Each runs as its own process (``python -m kvstore.bench.lookup.lookup_load ROLE ...``, or
``serve``: one job after another, each a JSON line on stdin) so that eight clients are eight
interpreters, as eight engine workers would be, not eight coroutines sharing one GIL. A job
connects and warms up, prints ``ready``, reads the wall-clock start time from stdin (sent
once all are ready), runs until start + ``--seconds`` and prints one JSON line of what it measured.

More: bench/lookup/README.md (### lookup_load.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import grpc
import torch

from kvstore import KVLayout, Namespace
from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.keys import page_keys

LOOKUP_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)
WRITER_LAYOUT = KVLayout(num_layers=36, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_tokens=16)
LOOKUP_NS = Namespace(model="lookup-bench", revision="r1", layout=LOOKUP_LAYOUT)
WRITER_NS = Namespace(model="lookup-bench-writer", revision="r1", layout=WRITER_LAYOUT)


def prefix_tokens(pages: int) -> list[int]:
    """The looked-up prefix: the same tokens in every process."""
    return [(i * 7919) % 50_000 for i in range(pages * LOOKUP_LAYOUT.page_tokens)]


def _ready() -> float:
    """Says ready, then waits for the start time (every process starts together)."""
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    delay = start - time.time()
    if delay > 0:
        time.sleep(delay)
    return start


def run_rpc(address: str, pages: int, seconds: float) -> dict[str, object]:
    keys = page_keys(LOOKUP_NS.namespace_id, prefix_tokens(pages), LOOKUP_LAYOUT.page_tokens)
    request = directory_pb2.LookupRequest(namespace_id=LOOKUP_NS.namespace_id, keys=keys)
    with grpc.insecure_channel(address) as channel:
        stub = directory_pb2_grpc.DirectoryStub(channel)
        for _ in range(20):  # warm-up: connection, first allocations
            stub.Lookup(request, timeout=10)
        start = _ready()
        latencies, short = [], 0
        end = start + seconds
        cpu0 = time.process_time()
        while time.time() < end:
            t0 = time.perf_counter()
            resp = stub.Lookup(request, timeout=10)
            latencies.append(time.perf_counter() - t0)
            short += resp.num_pages < pages
        cpu_s = time.process_time() - cpu0
    return {"latencies_s": latencies, "short": short, "path": "gRPC", "cpu_s": cpu_s}


async def _run_client(address: str, pages: int, seconds: float, with_keys: bool) -> dict[str, object]:
    """The ``client`` role, or with ``with_keys`` the ``keys`` role."""
    tokens = prefix_tokens(pages)
    async with KVStoreClient(address, LOOKUP_NS, use_shm=with_keys) as client:
        keys = client.keys(tokens)
        lookup = (lambda: client.lookup_keys(keys)) if with_keys else (lambda: client.lookup(tokens))
        for _ in range(5):
            await lookup()
        start = _ready()
        latencies, short = [], 0
        end = start + seconds
        cpu0 = time.process_time()
        while time.time() < end:
            t0 = time.perf_counter()
            hit = await lookup()
            latencies.append(time.perf_counter() - t0)
            short += hit.num_pages < pages
        cpu_s = time.process_time() - cpu0
        path = "call socket" if client.runtime.local is not None else "gRPC"
    return {"latencies_s": latencies, "short": short, "path": path, "cpu_s": cpu_s}


async def _run_writer(address: str, seconds: float, rate: float, count: int = 0) -> dict[str, object]:
    """Puts fresh pages for ``seconds`` (and at most ``count`` of them, when given): as fast as
    it can, or ``rate`` pages/s when given."""
    batch = 16
    kv = torch.randn(WRITER_LAYOUT.num_layers, 2, batch * 16, 8, 128).to(torch.bfloat16)
    written = 0
    async with KVStoreClient(address, WRITER_NS) as client:
        start = _ready()
        end = start + seconds
        # fresh tokens each run: a run starting where the last one did re-puts stored pages, which
        # count as written but demote nothing (a paced second run then demoted nothing at all)
        base = 1_000_000 + random.randrange(1 << 30)
        while time.time() < end and (count <= 0 or written < count):
            tokens = list(range(base, base + batch * 16))
            base += batch * 16
            written += await client.put(tokens, kv) // 16
            if rate > 0:
                await asyncio.sleep(max(0.0, start + written / rate - time.time()))
    return {"pages_written": written}


def run(role: str, address: str, pages: int = 512, seconds: float = 0.0, rate: float = 0.0, count: int = 0) -> dict[str, object]:
    """One job of ``role``: from connecting to what it measured."""
    if role == "rpc":
        return run_rpc(address, pages, seconds)
    if role in ("client", "keys"):
        return asyncio.run(_run_client(address, pages, seconds, role == "keys"))
    return asyncio.run(_run_writer(address, seconds, rate, count))


def serve() -> None:
    """Jobs one after another, each a JSON line of ``run``'s arguments on stdin, until it closes."""
    for line in sys.stdin:
        print(json.dumps(run(**json.loads(line))), flush=True)


def main(argv: list[str] | None = None) -> int:
    if (argv if argv is not None else sys.argv[1:]) == ["serve"]:
        serve()
        return 0
    p = argparse.ArgumentParser(prog="kvstore.bench.lookup.lookup_load")
    p.add_argument("role", choices=["rpc", "client", "keys", "writer"])
    p.add_argument("--address", required=True)
    p.add_argument("--pages", type=int, default=512)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--rate", type=float, default=0.0, help="writer: pages/s (0: as fast as it can)")
    p.add_argument("--count", type=int, default=0, help="writer: stop after this many pages (0: at the end of --seconds)")
    args = p.parse_args(argv)
    print(json.dumps(run(args.role, args.address, args.pages, args.seconds, args.rate, args.count)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
