"""kvstore-bench: one subcommand per question; tables on stdout, ``--json`` ends with one
JSON object."""

from __future__ import annotations

import argparse
import json
import sys

from kvstore import logs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore-bench", description="kvstore benchmarks against physical limits")
    parser.add_argument("--log-level", default="warning")
    sub = parser.add_subparsers(dest="command", required=True)

    from kvstore.bench import throughput

    tp = sub.add_parser("throughput", help="put/get GB/s per data path vs memcpy, raw disk, raw gRPC")
    throughput.add_arguments(tp)
    tp.add_argument("--json", action="store_true")
    tp.set_defaults(module=throughput)

    from kvstore.bench import overlap

    ov = sub.add_parser("overlap", help="layer-wise load vs serial on a real model (CPU)")
    overlap.add_arguments(ov)
    ov.add_argument("--json", action="store_true")
    ov.set_defaults(module=overlap)

    from kvstore.bench import replay

    rp = sub.add_parser("replay", help="trace replay: admission and eviction policies vs Belady")
    replay.add_arguments(rp)
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(module=replay)

    from kvstore.bench import crash

    cr = sub.add_parser("crash", help="SIGKILL the server under load, restart, check invariants")
    crash.add_arguments(cr)
    cr.add_argument("--json", action="store_true")
    cr.set_defaults(module=crash)

    from kvstore.bench import restart

    rs = sub.add_parser("restart", help="directory and index recovery time for N pages")
    restart.add_arguments(rs)
    rs.add_argument("--json", action="store_true")
    rs.set_defaults(module=restart)

    from kvstore.bench import crossover

    cx = sub.add_parser("crossover", help="fetch vs recompute on this machine, with the planner's predictions")
    crossover.add_arguments(cx)
    cx.add_argument("--json", action="store_true")
    cx.set_defaults(module=crossover)

    from kvstore.bench import checkpoint

    ck = sub.add_parser("checkpoint", help="KV checkpoint policies: SSD bytes vs tokens to recompute after a crash")
    checkpoint.add_arguments(ck)
    ck.add_argument("--json", action="store_true")
    ck.set_defaults(module=checkpoint)

    args = parser.parse_args(argv)
    logs.setup(args.log_level)
    report = args.module.run(args)
    args.module.print_table(report)
    if args.json:
        print(json.dumps(report))
    return 1 if report.get("num_violations") else 0


if __name__ == "__main__":
    sys.exit(main())
