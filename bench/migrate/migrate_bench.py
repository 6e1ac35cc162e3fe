"""kvstore-bench migrate: the catch-up of a live migration (DESIGN §12.8; the chapter's Fig. 9-43)
against the model S0 / (copy rate - growth rate), and the pause.

More: bench/migrate/README.md (### migrate_bench.py).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvstore import KVLayout
from kvstore.bench.common.cluster_procs import Etcd
from kvstore.bench.migrate import migrate_report
from kvstore.bench.migrate.migrate_row import RowSpec, measure_row
from kvstore.config import parse_size

UNCAPPED_GUESS_BPS = 0.2e9  # sizes the writer's budget (and so the nodes' host tiers) of the uncapped row only


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--copy-gbps", default="0.1,0.2,0.4,0,0.01",
                   help="the link caps of the rows, GB/s (0: not capped, loopback through the proxy); a cap <= --growth-gbps "
                        "is a cannot-converge row")
    p.add_argument("--growth-gbps", type=float, default=0.02, help="the writer's rate at the source while the migration runs")
    p.add_argument("--session", default="1GiB", help="S0 of the converging rows (both nodes' host tiers hold it and its growth)")
    p.add_argument("--small-session", default="8MiB", help="S0 of the cannot-converge rows (they copy for a few rounds only)")
    p.add_argument("--layers", type=int, default=8, help="of the layout: 8 KV heads x 128 x fp16 x 16 tokens, so a page is "
                   "layers x 64 KiB")
    p.add_argument("--data-plane", choices=("ucx", "tcp", "grpc"), default="tcp",
                   help="the nodes' --data-plane, over which the target pulls the session's pages (ucx: uncapped rows only)")
    p.add_argument("--max-pause-ms", type=float, default=10.0, help="client.migrate's: fence once the rest copies within this")
    p.add_argument("--sample-ms", type=float, default=50.0, help="the catch-up curve's sampling period at the target (0: round "
                   "ends only)")
    p.add_argument("--pump-s", type=float, default=1.0, help="the raw transfer's length at each cap (512 MiB when not capped)")
    p.add_argument("--dir", default="", help="the nodes' and etcd's folders (default: a temporary one, removed)")
    p.add_argument("--plot", default="bench-out/migrate.png", help="PNG of the catch-up curves with the model ('' for none)")


def _specs(args: argparse.Namespace, page_bytes: int) -> list[RowSpec]:
    g = args.growth_gbps * 1e9
    if g <= 0:
        raise SystemExit("--growth-gbps must be > 0")
    specs = []
    for text in str(args.copy_gbps).split(","):
        cap = float(text) * 1e9
        if cap < 0:
            raise SystemExit(f"--copy-gbps: {text} is negative")
        cap = math.inf if cap == 0 else cap
        if args.data_plane == "ucx" and not math.isinf(cap):
            raise SystemExit(f"--copy-gbps {text}: the UCX plane cannot be capped here (its transport connects past the "
                             "bench's link proxy): give --copy-gbps 0, or --data-plane tcp or grpc")
        small = cap <= g
        s0 = parse_size(args.small_session if small else args.session, "--session")
        s0 = max(page_bytes, s0 // page_bytes * page_bytes)
        nominal = s0 / ((UNCAPPED_GUESS_BPS if math.isinf(cap) else cap) - g) if not small else 0.0
        budget = 30.0 if small else min(300.0, 2 * nominal + 10)
        pump = 512 << 20 if math.isinf(cap) else max(1 << 20, int(cap * args.pump_s))
        specs.append(RowSpec(cap, g, s0, budget, args.sample_ms / 1000, args.max_pause_ms, pump, args.data_plane))
    return specs


def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = KVLayout(num_layers=args.layers, num_kv_heads=8, head_dim=128, dtype=torch.float16, page_tokens=16)
    specs = _specs(args, layout.page_bytes)
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvstore-bench-migrate-"))
    if args.dir:
        shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"page_bytes": layout.page_bytes, "growth_gbps": args.growth_gbps, "max_pause_ms": args.max_pause_ms,
                              "data_plane": args.data_plane, "load_average_start": [round(x, 2) for x in os.getloadavg()]}
    rows = []
    etcd = Etcd(workdir)
    try:
        with tqdm(total=len(specs), desc="migrate", unit="row", disable=None) as bar:
            for i, spec in enumerate(specs):
                rows.append(migrate_report.summarize_row(spec, measure_row(workdir, etcd, i, spec, layout), layout.page_bytes))
                bar.update(1)
    finally:
        etcd.stop()
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    report["rows"] = rows
    report["goals"] = migrate_report.goals(rows)
    report["all_goals_met"] = all(report["goals"].values())
    report["load_average_1m"] = round(os.getloadavg()[0], 2)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        migrate_report.plot(report, args.plot)
        report["plot"] = args.plot
    return report


def print_table(report: dict[str, Any]) -> None:
    migrate_report.print_table(report)
