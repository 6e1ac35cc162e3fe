"""kvstore-bench chaos: random concurrent traffic on a 3-node cluster under random faults,
each history checked against a simple model (see bench/chaos/README.md). Seeded: history i
of ``--seed S`` is ``--seed S+i --histories 1``. A failing history is written out as JSON and
shrunk; exit status 1 on any violation."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvstore.bench.chaos.faults import DATA_LINK_KINDS, DATA_PLANES, KINDS, kinds_for
from kvstore.bench.chaos.runner import Settings, run_histories


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--histories", type=int, default=20, help="histories to run on one cluster (every namespace of a history is invalidated after it)")
    p.add_argument("--seed", type=int, default=0, help="history i runs with seed SEED+i")
    p.add_argument("--ops-per-history", type=int, default=250, help="operations planned per history")
    p.add_argument("--workers", type=int, default=4, help="concurrent clients' loops per history")
    p.add_argument("--traffic-s", type=float, default=10.0, help="each history's ops are spread over this long")
    p.add_argument("--timeout-s", type=float, default=5.0, help="every client call's deadline")
    p.add_argument("--kinds", default="all",
                   help=f"fault kinds, comma-separated; all: every kind, {','.join(KINDS)}, or with --data-plane ucx all but "
                        f"{','.join(DATA_LINK_KINDS)} (no proxy can sit in front of UCX's data connections, and naming it fails)")
    p.add_argument("--shrink-attempts", type=int, default=6, help="reruns to shrink a failing history")
    p.add_argument("--dir", default=None, help="the cluster's files and failing histories (None: a new temporary dir, "
                   "removed at the end when no history violated anything)")
    p.add_argument("--server-log-level", default="warning", help="the nodes' --log-level")
    p.add_argument("--data-plane", default="grpc", choices=DATA_PLANES,
                   help="how nodes move pages (tcp: also a handoff's layers ahead of its commit, DESIGN §12.7; ucx: UCX over "
                        "TCP on loopback, the nodes' --data-plane ucx --ucx-tls tcp, without the data link faults)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        kinds = tuple(kinds_for(args.data_plane, None if args.kinds == "all" else [k for k in args.kinds.split(",") if k]))
    except ValueError as exc:
        raise SystemExit(f"--kinds: {exc}") from None
    settings = Settings(num_ops=args.ops_per_history, workers=args.workers, traffic_s=args.traffic_s,
                        timeout_s=args.timeout_s, kinds=kinds)
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvstore-chaos-"))
    with tqdm(total=args.histories, desc="chaos", unit="history", disable=None) as bar:
        report = asyncio.run(run_histories(workdir, args.seed, args.histories, settings, args.shrink_attempts,
                                           args.server_log_level, bar, args.data_plane))
    report["dir"] = str(workdir)
    if not args.dir and not report["num_violations"] and not report["written"]:  # nothing to look into: the nodes'
        shutil.rmtree(workdir, ignore_errors=True)  # files and logs went with the run (~1.5 MB a run, left before)
        report["dir"] = None
    return report


def print_table(report: dict[str, Any]) -> None:
    for key in ("histories", "operations", "ssd_pages_damaged", "violations", "convergence_p50_s", "convergence_p99_s", "convergence_max_s",
                "not_converged", "elapsed_s", "dir"):
        print(f"{key:>20}: {report[key]}")
    for kind, count in report["faults"].items():
        print(f"{'faults ' + kind:>20}: {count}")
    first, last = report["steady_first"], report["steady_last"]
    if first:
        print(f"{'steady node anon':>20}: {first['anon'] >> 20} -> {last['anon'] >> 20} MiB "
              f"(C heap in use {first.get('heap_in_use', 0) >> 20} -> {last.get('heap_in_use', 0) >> 20} MiB), "
              f"fds {first['fds']} -> {last['fds']}")
    for v in report["violation_samples"]:
        print(f"  VIOLATION seed {v['seed']} ({v['check']}): {v['what']}")
    for path in report["written"]:
        print(f"  history written: {path}")
    for command in report["reproduce"]:
        print(f"  reproduce: {command}")
