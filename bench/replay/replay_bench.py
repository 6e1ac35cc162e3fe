"""kvstore-bench replay: drive the real placement core, admission and eviction code with a
Mooncake-format trace (one page per 512-token block, payloads scaled down), on simulated
time, and compare policies with the offline optimum (Belady) at the same capacity.

More: bench/replay/README.md (### replay_bench.py).
"""

from __future__ import annotations

import argparse
import bisect
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvstore.bench.replay.belady import belady_hits
from kvstore.bench.replay.replay_pool import pooled_vs_isolated, print_pool
from kvstore.config import HostTierConfig, ServerConfig, SsdTierConfig
from kvstore.page import LayoutDesc, checksum
from kvstore.planner import SECONDS_PER_DAY
from kvstore.server.admission import Decision, WriteBudget
from kvstore.server.metrics import Metrics
from kvstore.server.placement import Placement

NS = b"replay-namespace"


@dataclass
class Req:
    t: float
    blocks: list[int]


def load_trace(path: str, limit: int = 0) -> list[Req]:
    reqs = []
    with open(path) as f:
        for line in f:
            if line.strip():
                doc = json.loads(line)
                reqs.append(Req(doc["timestamp"] / 1000.0, [int(h) for h in doc["hash_ids"]]))
                if limit and len(reqs) >= limit:
                    break
    return reqs


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _key(block: int) -> bytes:
    return block.to_bytes(16, "little")


class OracleAdmission:
    """A reference, not a policy a server can run: it reads the future of the trace and
    admits a page leaving the host tier when the trace uses it at least twice more (within
    the budget). It bounds what an online policy can keep at the same budget, as Belady
    bounds eviction."""

    name = "oracle"

    def __init__(self, reqs: list[Req]) -> None:
        self.uses: dict[bytes, list[float]] = {}
        for req in reqs:
            for block in req.blocks:
                self.uses.setdefault(_key(block), []).append(req.t)

    def can_admit(self, key: bytes, flags: int, budget: WriteBudget, num_bytes: int) -> Decision:
        uses = self.uses.get(key, [])
        future = len(uses) - bisect.bisect_right(uses, budget.clock())
        if future < 2:
            return Decision(False, "one-shot")
        return Decision(budget.can_take(num_bytes), "future")

    def record_access(self, key: bytes) -> None:
        pass

    def record_refused(self, key: bytes) -> None:
        pass


def replay(reqs: list[Req], host_blocks: int, ssd_blocks: int, policy: str, dwpd: float, window_s: float,
           page_bytes: int, workdir: Path, progress: bool = False, hint_share: float = 0.5, eviction: str = "slru") -> dict[str, Any]:
    """One run; returns hit rates and SSD write figures."""
    layout = LayoutDesc(1, 2, 1, page_bytes // 4, "float16", 1)
    assert layout.page_bytes == page_bytes
    clock = SimClock()
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    ssd = None
    if ssd_blocks:
        ssd = SsdTierConfig(directory=run_dir / "ssd", capacity_bytes=ssd_blocks * (page_bytes + 4096), direct_io=False,
                            dwpd=dwpd, admission="all" if policy == "oracle" else policy, sync=False, slab_bytes=8 * (page_bytes + 4096))
    config = ServerConfig(
        listen="127.0.0.1:0", data_dir=run_dir / "data", tiers=("host", "ssd") if ssd else ("host",),
        # Every queued request's blocks are hinted, as the trace's engine would: the replay
        # measures the policies, so the server's memory bound on hints (--max-hints) is lifted.
        host=HostTierConfig(capacity_bytes=host_blocks * page_bytes, slab_bytes=8 * page_bytes, hint_share=hint_share,
                            eviction=eviction, max_hints=1 << 40),
        ssd=ssd, metrics_listen=None, node=f"replay{run_dir.name}",
    )
    # No demoter thread: every eviction happens inline, in the order allocations need room,
    # so the figures are deterministic.
    core = Placement(config, Metrics(), clock=clock, policy=OracleAdmission(reqs) if policy == "oracle" and ssd else None)
    budget = core.lower[0].budget if core.lower else None
    payload = bytearray(page_bytes)
    hits = host_hits = ssd_hits = total = 0
    next_hint = 0
    try:
        for i, req in enumerate(tqdm(reqs, desc=f"{policy} h={host_blocks} s={ssd_blocks} W={window_s:g}", disable=not progress, leave=False)):
            clock.now = req.t
            if window_s > 0:
                next_hint = max(next_hint, i + 1)
                while next_hint < len(reqs) and reqs[next_hint].t <= req.t + window_s:
                    later = reqs[next_hint]
                    core.hint(NS, [_key(b) for b in later.blocks], later.t - req.t)
                    next_hint += 1
            keys = [_key(b) for b in req.blocks]
            in_host = [core.residence.has(k, 0) for k in keys]  # tier 0: the landing tier (host)
            ident, pages = core.acquire(NS, keys, 0)
            core.release(ident)
            served = len(pages)
            hits += served
            host_hits += sum(in_host[:served])
            ssd_hits += served - sum(in_host[:served])
            total += len(keys)
            missing = keys[served:]
            if missing:
                alloc, slots = core.allocate(NS, layout, missing)
                written, sums = [], []
                for key, offset in slots:
                    if offset is None:
                        continue
                    payload[:16] = key
                    core.slot_view(alloc, key)[:] = payload
                    written.append(key)
                    sums.append(checksum(payload))
                core.commit(alloc, written, sums)
        written_blocks = budget.written_bytes // page_bytes if budget else 0
        duration = max(1e-9, reqs[-1].t - reqs[0].t)
        budget_blocks = (budget.rate_bps * duration + budget.burst_bytes) / page_bytes if budget and not budget.unlimited else None
    finally:
        core.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "policy": policy if ssd_blocks else ("queue-aware" if window_s > 0 else eviction),
        "window_s": window_s, "host_blocks": host_blocks, "ssd_blocks": ssd_blocks, "dwpd": dwpd,
        "hit_rate": hits / total, "host_hit_rate": host_hits / total, "ssd_hit_rate": ssd_hits / total,
        "ssd_blocks_written": int(written_blocks), "ssd_budget_blocks": None if budget_blocks is None else int(budget_blocks),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    p.add_argument("--suite", default="admission,eviction", help="admission, eviction, pool (real processes), comma-separated")
    p.add_argument("--host-blocks", type=int, default=1000, help="host tier capacity for the admission suite")
    p.add_argument("--ssd-blocks", type=int, default=50_000, help="SSD tier capacity for the admission suite")
    p.add_argument("--policies", default="first-come,seen-twice,value,oracle",
                   help="admission policies compared with 'all' ('oracle' reads the trace's future: a reference bound)")
    p.add_argument("--budget-of-all", type=float, default=1 / 3, help="write budget as a share of what 'all' writes")
    p.add_argument("--dwpd", type=float, default=0.0, help="explicit DWPD for the budgeted policies (overrides --budget-of-all)")
    p.add_argument("--capacities", default="1000,5000,10000", help="host capacities (blocks) for the eviction suite")
    p.add_argument("--window", type=float, default=30.0, help="queue lookahead W in seconds for queue-aware eviction")
    p.add_argument("--hint-share", type=float, default=0.9, help="share of the host tier hints may protect (server default 0.5)")
    p.add_argument("--page-bytes", type=int, default=4096, help="scaled-down payload per 512-token block")
    p.add_argument("--limit-requests", type=int, default=0, help="replay only the first N requests")
    p.add_argument("--pool-nodes", type=int, default=4, help="engine nodes of the pool suite (requests round-robin)")
    p.add_argument("--pool-blocks", type=int, default=8192,
                   help="host-tier blocks of the pool suite, all nodes together (the trace has 43,924 distinct blocks)")
    p.add_argument("--plot", default="bench-out/replay-hit-rate.png", help="PNG of hit rate vs capacity per policy")
    p.add_argument("--dir", default="bench-out/replay")


def run(args: argparse.Namespace) -> dict[str, Any]:
    reqs = load_trace(args.trace, args.limit_requests)
    seq = [b for r in reqs for b in r.blocks]
    workdir = Path(args.dir)
    workdir.mkdir(parents=True, exist_ok=True)
    suites = set(args.suite.split(","))
    results: list[dict[str, Any]] = []
    progress = True
    if "admission" in suites:
        base = replay(reqs, args.host_blocks, args.ssd_blocks, "all", 0.0, 0.0, args.page_bytes, workdir, progress)
        belady = belady_hits(seq, args.host_blocks + args.ssd_blocks) / len(seq)
        base["belady_hit_rate"] = belady
        results.append(base)
        duration = reqs[-1].t - reqs[0].t
        ssd_bytes = args.ssd_blocks * (args.page_bytes + 4096)
        dwpd = args.dwpd or args.budget_of_all * base["ssd_blocks_written"] * args.page_bytes / duration * SECONDS_PER_DAY / ssd_bytes
        for policy in args.policies.split(","):
            r = replay(reqs, args.host_blocks, args.ssd_blocks, policy, dwpd, 0.0, args.page_bytes, workdir, progress)
            r["belady_hit_rate"] = belady
            r["ssd_hits_kept"] = r["ssd_hit_rate"] / base["ssd_hit_rate"] if base["ssd_hit_rate"] else None
            results.append(r)
    if "eviction" in suites:
        for cap in [int(c) for c in args.capacities.split(",")]:
            belady = belady_hits(seq, cap) / len(seq)
            lru = replay(reqs, cap, 0, "lru", 0.0, 0.0, args.page_bytes, workdir, progress, eviction="lru")
            slru = replay(reqs, cap, 0, "lru", 0.0, 0.0, args.page_bytes, workdir, progress, eviction="slru")
            queue = replay(reqs, cap, 0, "lru", 0.0, args.window, args.page_bytes, workdir, progress, args.hint_share)
            gap = belady - lru["hit_rate"]
            for r in (lru, slru, queue):
                r["belady_hit_rate"] = belady
            for r in (slru, queue):
                r["gap_closed"] = (r["hit_rate"] - lru["hit_rate"]) / gap if gap > 0 else None
            results += [lru, slru, queue]
    report: dict[str, Any] = {"trace": args.trace, "requests": len(reqs), "blocks": len(seq), "results": results}
    if "pool" in suites:
        report["pool"] = pooled_vs_isolated([r.blocks for r in reqs], args.pool_nodes, args.pool_blocks, workdir)
    if "eviction" in suites and args.plot:
        report["plot"] = _plot(results, args.plot, args.window)
    return report


def _plot(results: list[dict[str, Any]], path: str, window: float) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        if r["ssd_blocks"] == 0:
            name = f"queue-aware slru (W={window:g}s)" if r["policy"] == "queue-aware" else r["policy"]
            series.setdefault(name, []).append((r["host_blocks"], r["hit_rate"]))
            series.setdefault("belady (offline optimum)", []).append((r["host_blocks"], r["belady_hit_rate"]))
    for name, pts in series.items():
        pts = sorted(set(pts))
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=name, linestyle="--" if "belady" in name else "-")
    ax.set_xscale("log")
    ax.set_xlabel("host tier capacity (512-token blocks)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title("Mooncake trace replay: hit rate vs capacity")
    ax.grid(True, alpha=0.3)
    ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_table(report: dict[str, Any]) -> None:
    print(f"{report['requests']} requests, {report['blocks']} block accesses")
    if report["results"]:
        print(f"{'policy':<12} {'W s':>5} {'host':>6} {'ssd':>6} {'hit%':>6} {'host%':>6} {'ssd%':>6} {'written':>8} {'budget':>8} {'belady%':>8} {'kept/closed':>11}")
    for r in report["results"]:
        extra = r.get("ssd_hits_kept", r.get("gap_closed"))
        print(f"{r['policy']:<12} {r['window_s']:>5g} {r['host_blocks']:>6} {r['ssd_blocks']:>6} {100 * r['hit_rate']:>6.1f} "
              f"{100 * r['host_hit_rate']:>6.1f} {100 * r['ssd_hit_rate']:>6.1f} {r['ssd_blocks_written']:>8} "
              f"{r['ssd_budget_blocks'] if r['ssd_budget_blocks'] is not None else '-':>8} {100 * r['belady_hit_rate']:>8.1f} "
              f"{'-' if extra is None else f'{100 * extra:.0f}%':>11}")
    if report.get("pool"):
        print_pool(report["pool"])
    if report.get("plot"):
        print(f"plot: {report['plot']}")
