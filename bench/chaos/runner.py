"""One chaos history on a running cluster, start to verdict: plan it from its seed, run the
traffic with faults injected, heal, check the record (``chaos_validate.py``), wait for the cluster
to converge (``converge.py``). ``run_histories`` runs many on one cluster, writes out and
shrinks the failing ones, and checks the steady node's resources across them (e)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.bench.chaos.chaos_calls import Clients
from kvstore.bench.chaos.chaos_cluster import TENANTS, TTL_S, ChaosCluster
from kvstore.bench.chaos.chaos_validate import check
from kvstore.bench.chaos.converge import Convergence
from kvstore.bench.chaos.faults import Injector, heal_all, kinds_for, plan_faults
from kvstore.bench.chaos.history import History, Op, Violation, shrink
from kvstore.bench.chaos.traffic import NAMESPACES_PER_TENANT, Traffic, plan_traffic
from kvstore.bench.common.harness import percentile

logger = logging.getLogger(__name__)

# (e): the steady node's heap (RssAnon: the arena and LMDB's maps are bounded by their
# capacity flags and show as shmem/file) and descriptors may grow by 10 %, or by this much
RSS_SLACK_BYTES = 8 << 20
FD_SLACK = 8


@dataclass(frozen=True)
class Settings:
    num_ops: int = 250
    workers: int = 4
    traffic_s: float = 10.0  # the ops of a history are spread over this long, and faults drawn in it
    timeout_s: float = 5.0  # every client's per-RPC deadline
    kinds: tuple[str, ...] | None = None  # None: every kind the cluster's data plane can inject (faults.kinds_for)
    deadline_s: float = 2 * TTL_S  # (b) and (c) must hold this long after the heal
    late_s: float = 15.0  # polled this long to tell late from never (past 2 x TTL, a cluster that converges has)


class Runner:
    def __init__(self, cluster: ChaosCluster, settings: Settings, on_op: Callable[[Op], None] | None = None) -> None:
        self.cluster = cluster
        self.settings = settings
        self.on_op = on_op
        self._attempt = 0  # namespaces are new per run of a history, also a rerun of the same seed

    async def history(self, seed: int, num_ops: int | None = None, kinds: list[str] | None = None,
                      clean_up: bool = True) -> History:
        """One history of ``seed``, checked. ``clean_up``: its namespaces invalidated at every node
        afterwards (~3 s after faults: each waits out the fence wait of a node that left); a last
        history, after which nothing runs on the cluster, is better left without."""
        s = self.settings
        kinds = kinds_for(self.cluster.data_plane, s.kinds if kinds is None else kinds)  # ValueError: not on this plane
        history = History(seed=seed, num_ops=s.num_ops if num_ops is None else num_ops, kinds=kinds)
        rng = random.Random(seed)
        ops_rng, faults_rng = random.Random(rng.getrandbits(64)), random.Random(rng.getrandbits(64))
        self._attempt += 1
        namespaces = [f"chaos-{seed}-{self._attempt}-{i}" for i in range(NAMESPACES_PER_TENANT)]
        names = [n.name for n in self.cluster.nodes]
        traffic_s = s.traffic_s * history.num_ops / s.num_ops  # a shrunk history: the same pace, ending sooner
        roots, plan = plan_traffic(ops_rng, history.num_ops, s.workers, names, [t.name for t in TENANTS], namespaces, traffic_s)
        slots = plan_faults(faults_rng, names, self.cluster.steady.name, kinds, math.ceil(traffic_s / 1.2) + 4)
        history.reproduce = (f"kvstore-bench chaos --histories 1 --seed {seed} --ops-per-history {history.num_ops} "
                             f"--workers {s.workers} --traffic-s {traffic_s:g} --timeout-s {s.timeout_s} --kinds {','.join(kinds)} "
                             f"--data-plane {self.cluster.data_plane}")
        clients = Clients(self.cluster, namespaces, s.timeout_s)
        try:
            await clients.open()
            t0, wall_start = time.monotonic(), time.time()  # wall_start: to find the history in the nodes' logs
            traffic, injector, stop = Traffic(clients, roots, plan, s.workers, self.on_op), Injector(self.cluster), asyncio.Event()
            injecting = asyncio.ensure_future(injector.run(slots, stop))
            try:
                history.ops = await traffic.run()
            finally:
                stop.set()
                history.faults = await injecting
            t1 = time.monotonic()
            died = await heal_all(self.cluster)
            healed_at = time.monotonic()
            history.violations = [Violation("crash", d) for d in died]
            history.violations += [Violation("fault", f"{f.kind} on {f.target} did not heal: {f.error}") for f in history.faults
                                   if f.error]
            history.violations += check(history, s.timeout_s)
            converged_s, found = await Convergence(history, clients, roots).wait(healed_at, s.deadline_s, s.late_s)
            history.violations += found
            history.timings = {"wall_start": wall_start, "traffic_s": t1 - t0, "heal_s": healed_at - t1,
                               "convergence_s": converged_s if converged_s is not None else -1.0}  # -1: never
            history.resources = self.cluster.steady.resources()
            if clean_up:
                await clients.invalidate_all()
        finally:
            await clients.close()
        _relative(history, t0)
        return history


def _relative(history: History, t0: float) -> None:
    """Times in the record as seconds since the traffic began (the monotonic clock's origin means nothing)."""
    for op in history.ops:
        op.start, op.end = round(op.start - t0, 4), round(op.end - t0, 4)
    for f in history.faults:
        f.start, f.healed = round(f.start - t0, 4), round(f.healed - t0, 4)


@dataclass
class Tally:
    histories: int = 0
    operations: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    damaged_pages: int = 0  # pages an ssd_flip damaged (the model lets (b) lose them)
    errors: Counter[str] = field(default_factory=Counter)
    violations: list[dict[str, Any]] = field(default_factory=list)
    convergence_s: list[float] = field(default_factory=list)  # -1: did not converge
    written: list[str] = field(default_factory=list)
    reproduce: list[str] = field(default_factory=list)  # of the shrunk histories
    resources: list[dict[str, int]] = field(default_factory=list)
    slowest_s: dict[str, float] = field(default_factory=dict)  # per op kind: the longest call (for d's margin)

    def add(self, history: History) -> None:
        self.histories += 1
        self.operations += len(history.ops)
        self.faults.update(f.kind for f in history.faults)
        self.damaged_pages += sum(len(f.keys) for f in history.faults)
        self.errors.update(f"{op.kind}:{op.error}" for op in history.ops if op.error)
        self.violations += [{"seed": history.seed, "check": v.check, "what": v.what} for v in history.violations]
        self.convergence_s.append(history.timings.get("convergence_s", -1.0))
        self.resources.append(history.resources)
        for op in history.ops:
            self.slowest_s[op.kind] = round(max(self.slowest_s.get(op.kind, 0.0), op.end - op.start), 3)


def resource_violations(resources: list[dict[str, int]]) -> list[dict[str, Any]]:
    """(e): the steady node's RssAnon and descriptors from the end of the first history to the
    end of the last. The C heap's bytes in use (``heap_in_use``, where the node exports it) are
    named beside: RssAnon also holds freed buffers malloc keeps on purpose (kvstore/memory.py),
    which mallinfo cannot tell apart from untouched free space, so RssAnon is what is bounded."""
    if len(resources) < 2:
        return []
    first, last = resources[0], resources[-1]
    found = []
    for name, slack in (("anon", RSS_SLACK_BYTES), ("fds", FD_SLACK)):
        if last[name] - first[name] > max(0.10 * first[name], slack):
            heap = f" (C heap in use {first['heap_in_use']} -> {last['heap_in_use']})" if name == "anon" and "heap_in_use" in last else ""
            found.append({"seed": None, "check": "e", "what": f"steady node {name} grew from {first[name]} to {last[name]}{heap}"})
    return found


async def run_histories(workdir: Path, seed: int, histories: int, settings: Settings, shrink_attempts: int = 6,
                        log_level: str = "warning", bar: Any = None, data_plane: str = "grpc") -> dict[str, Any]:
    """``histories`` histories of seeds ``seed``, ``seed + 1``, ... on one cluster (etcd + 3 nodes)."""
    tally = Tally()
    started = time.monotonic()
    cluster = ChaosCluster(workdir / "cluster", 3, log_level, data_plane)
    try:
        await asyncio.to_thread(cluster.start)
        runner = Runner(cluster, settings)
        shrunk: set[str] = set()  # checks a shrunk history of this run violates: one shrink per check
        for i in range(histories):
            history = await runner.history(seed + i)
            tally.add(history)
            if history.violations:
                tally.written.append(str(history.write(workdir / f"history-{history.seed}.json")))
                if {v.check for v in history.violations} - shrunk:
                    smallest = await shrink(history, runner.history, shrink_attempts)
                    tally.written.append(str(smallest.write(workdir / f"history-{history.seed}-shrunk.json")))
                    tally.reproduce.append(smallest.reproduce)
                    shrunk |= {v.check for v in history.violations}
            if bar is not None:
                bar.update(1)
                bar.set_postfix(ops=tally.operations, faults=sum(tally.faults.values()), violations=len(tally.violations))
    finally:
        await asyncio.to_thread(cluster.close)
    tally.violations += resource_violations(tally.resources)
    finite = [c for c in tally.convergence_s if c >= 0]
    return {
        "histories": tally.histories, "operations": tally.operations, "faults": dict(sorted(tally.faults.items())),
        "ssd_pages_damaged": tally.damaged_pages,
        "violations": len(tally.violations), "num_violations": len(tally.violations), "seed": seed,
        "convergence_p50_s": _rounded(percentile(finite, 0.5)), "convergence_p99_s": _rounded(percentile(finite, 0.99)),
        "convergence_max_s": _rounded(max(finite, default=math.nan)), "not_converged": len(tally.convergence_s) - len(finite),
        "failed_seeds": sorted({v["seed"] for v in tally.violations if v["seed"] is not None}),
        "violation_samples": tally.violations[:20], "errors": dict(tally.errors.most_common()), "slowest_s": tally.slowest_s, "written": tally.written,
        "reproduce": tally.reproduce,
        "steady_first": tally.resources[0] if tally.resources else {}, "steady_last": tally.resources[-1] if tally.resources else {},
        "steady_series": tally.resources,
        "elapsed_s": round(time.monotonic() - started, 1), "settings": {**settings.__dict__, "kinds": kinds_for(data_plane, settings.kinds)},
    }


def _rounded(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds, 3)
