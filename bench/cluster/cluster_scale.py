"""The cluster benchmark's scaling row and its PNG.

Scaling: aggregate lookups/s of the cluster, one engine per node looking up, as fast as it
can, a 512-page prefix that the next node stored (so every lookup fans out to the owners),
all engines at once for ``seconds``; run on 3 nodes, then again after 2 more joined. On
loopback every node shares this machine's cores, so the figure shows what the fan-out
costs as N grows, not what N machines would serve.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from kvstore import Namespace
from kvstore.bench.common.cluster_procs import Node
from kvstore.client import KVStoreClient

PREFIX_PAGES = 512


async def lookup_rate(nodes: list[Node], seconds: float, layout: Any, tokens_of: Any, kv_of: Any) -> dict[str, Any]:
    ns = Namespace(model=f"bench-scale-{len(nodes)}", revision="r1", layout=layout)
    clients = [KVStoreClient(n.address, ns) for n in nodes]
    try:
        for c in clients:
            await c.connect()
        chains = []
        for i, c in enumerate(clients):
            tokens = tokens_of(1000 + i, PREFIX_PAGES, layout)
            await c.put(tokens, kv_of(layout, len(tokens), i))
            reader = clients[(i + 1) % len(clients)]
            deadline = time.monotonic() + 10
            while (await reader.lookup(tokens)).num_tokens < len(tokens):
                if time.monotonic() > deadline:
                    raise RuntimeError("a stored prefix did not become visible in time")
                await asyncio.sleep(0.02)
            chains.append(reader.keys(tokens))

        async def engine(client: KVStoreClient, keys: list[bytes], stop: float) -> int:
            n = 0
            while time.monotonic() < stop:
                await client.lookup_keys(keys)
                n += 1
            return n

        stop = time.monotonic() + seconds
        counts = await asyncio.gather(*(engine(clients[(i + 1) % len(clients)], chains[i], stop) for i in range(len(clients))))
    finally:
        for c in clients:
            await c.close()
    return {"nodes": len(nodes), "lookups_per_s": round(sum(counts) / seconds, 1),
            "per_node_per_s": round(sum(counts) / seconds / len(nodes), 1)}


def plot(report: dict[str, Any], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    ax = axes[0][0]
    rows = report["remote_get"]
    labels = [r["transport"] for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["gbps"] for r in rows], 0.4, label="kvstore remote get")
    ax.bar([x + 0.2 for x in xs], [r["raw_gbps"] for r in rows], 0.4, label="raw pump, same transport")
    if report.get("mooncake_remote_gbps"):
        ax.axhline(report["mooncake_remote_gbps"], color="gray", linestyle="--", label="Mooncake Store remote TCP get")
    ax.set_xticks(list(xs), labels)
    top = max([r["raw_gbps"] for r in rows] + [r["gbps"] for r in rows] + [report.get("mooncake_remote_gbps") or 0])
    ax.set_ylim(0, 1.45 * top)  # room for the legend above the bars
    ax.set_ylabel("GB/s")
    ax.set_title(f"remote get, {report['pages']} pages of {report['page_bytes'] >> 20} MiB")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    lk = report["lookup"]
    ax.bar(["p50", "p99"], [lk["p50_ms"], lk["p99_ms"]])
    ax.axhline(5.0, color="gray", linestyle="--", label="goal p99 5 ms")
    ax.set_ylabel("ms")
    ax.set_title(f"lookup of a {lk['pages']}-page prefix over {lk['owners']} owners")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    if report.get("pooled") and report.get("isolated"):
        ax.bar(["pooled cluster", "isolated per node"], [100 * report["pooled"]["hit_rate"], 100 * report["isolated"]["hit_rate"]])
        pool = report["pool"]
        ax.set_title(f"hit rate, {pool['requests']} requests over {pool['nodes']} nodes, {pool['capacity_blocks']} blocks")
    ax.set_ylabel("hit rate (%)")
    ax = axes[1][1]
    scale = report.get("scaling") or []
    ax.bar([f"{s['nodes']} nodes" for s in scale], [s["lookups_per_s"] for s in scale])
    ax.set_ylabel("lookups/s, all engines")
    ax.set_title(f"aggregate {PREFIX_PAGES}-page lookups (one engine per node)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
