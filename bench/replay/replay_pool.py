"""kvstore-bench replay --suite pool: the hit rate of one pooled cluster cache against
isolated per-node caches of the same total capacity, on a Mooncake-format trace (DESIGN §12:
the reason a cluster exists).

More: bench/replay/README.md (### replay_pool.py).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvstore import KVLayout, Namespace
from kvstore.bench.common.cluster_procs import Etcd, start_nodes
from kvstore.client import KVStoreClient
from kvstore.errors import PageMissing

# one 4 KiB page per 512-token block: the hit rate depends on the number of pages a node
# holds, not on their size, and small pages keep a replay of 120,000 blocks short
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float16, page_tokens=16)
VISIBLE_WAIT_S = 1.0


def block_tokens(blocks: list[int]) -> list[int]:
    """Tokens whose page keys chain like the trace's block ids: equal ids, equal prefix."""
    return [b * LAYOUT.page_tokens + i for b in blocks for i in range(LAYOUT.page_tokens)]


def host_capacity(capacity_blocks: int, nodes: int) -> str:
    """Each node's --host-capacity: whole 4 MiB slabs (the host tier rounds down to slabs)."""
    per_node = capacity_blocks // nodes * LAYOUT.page_bytes
    return str(max(4 << 20, per_node - per_node % (4 << 20)))


async def _visible(client: KVStoreClient, keys: list[bytes], want: int) -> bool:
    deadline = time.monotonic() + VISIBLE_WAIT_S
    while (await client.lookup_keys(keys)).num_tokens < want:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


async def drive(addresses: list[str], reqs: list[list[int]], pooled: bool, label: str) -> dict[str, Any]:
    """Replays ``reqs`` round-robin over the servers; hit rate and counters."""
    ns = Namespace(model="bench-pool", revision="r1", layout=LAYOUT)
    clients = [KVStoreClient(a, ns) for a in addresses]
    hits = listed = total = short = late = 0
    g = torch.Generator().manual_seed(0)
    longest = max(len(r) for r in reqs) * LAYOUT.page_tokens
    payload = torch.randn((LAYOUT.num_layers, LAYOUT.kv_factor, longest, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                          generator=g).to(LAYOUT.torch_dtype())
    out = torch.empty_like(payload)
    t0 = time.perf_counter()
    try:
        for c in clients:
            await c.connect()
        for i, blocks in enumerate(tqdm(reqs, desc=label, leave=False)):
            client = clients[i % len(clients)]
            tokens = block_tokens(blocks)
            keys = client.keys(tokens)
            hit = await client.lookup_keys(keys)
            got = 0
            if hit.num_tokens:
                try:
                    got = await client.get(hit, out)
                except PageMissing as exc:  # evicted or its holder failed between lookup and get: a shorter hit
                    got, short = getattr(exc, "num_tokens", 0), short + 1
            total += len(keys)
            hits += got // LAYOUT.page_tokens
            listed += hit.num_tokens // LAYOUT.page_tokens
            if got < len(tokens):
                stored = await client.put_keys(keys, payload[:, :, : len(tokens)].contiguous())
                if pooled and len(clients) > 1 and not await _visible(clients[(i + 1) % len(clients)], keys, stored):
                    late += 1
    finally:
        for c in clients:
            await c.close()
    return {"hit_rate": round(hits / total, 4), "listed_rate": round(listed / total, 4), "blocks": total,
            "short_gets": short, "late_records": late, "seconds": round(time.perf_counter() - t0, 1)}


def pooled_vs_isolated(reqs: list[list[int]], nodes: int, capacity_blocks: int, workdir: Path | None = None,
                       data_plane: str = "ucx", ttl_s: int = 10) -> dict[str, Any]:
    """Both runs; returns {"pooled": {...}, "isolated": {...}, "nodes", "capacity_blocks"}."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="kvstore-bench-pool-"))
    host = host_capacity(capacity_blocks, nodes)
    names = [f"n{i}" for i in range(nodes)]
    report: dict[str, Any] = {"nodes": nodes, "capacity_blocks": nodes * int(host) // LAYOUT.page_bytes,
                              "page_bytes": LAYOUT.page_bytes, "requests": len(reqs)}
    etcd = Etcd(workdir)
    try:
        members = start_nodes(workdir, etcd, "pool", names, data_plane, ttl_s, host)
        try:
            report["pooled"] = asyncio.run(drive([n.address for n in members], reqs, True, "pooled"))
        finally:
            for node in members:
                node.stop()
    finally:
        etcd.stop()
    isolated = start_nodes(workdir, None, "isolated", names, data_plane, ttl_s, host)
    try:
        report["isolated"] = asyncio.run(drive([n.address for n in isolated], reqs, False, "isolated"))
    finally:
        for node in isolated:
            node.stop()
    return report


def print_pool(report: dict[str, Any]) -> None:
    print(f"pooled vs isolated: {report['requests']} requests round-robin over {report['nodes']} engine nodes, "
          f"{report['capacity_blocks']} blocks of host tier in all")
    print(f"{'cache':>9} {'hit%':>6} {'listed%':>8} {'short gets':>10} {'late records':>12} {'seconds':>8}")
    for name in ("pooled", "isolated"):
        r = report[name]
        print(f"{name:>9} {100 * r['hit_rate']:>6.1f} {100 * r['listed_rate']:>8.1f} {r['short_gets']:>10} "
              f"{r['late_records']:>12} {r['seconds']:>8}")
