"""kvstore-bench: one subcommand per question; tables on stdout, ``--json`` ends with one
JSON object, progress bars on stderr. Exit status 1 when a run found a violation."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
from types import ModuleType

from kvstore import logs
from kvstore.bench.common.harness import exit_now
from kvstore.cli.client_args import add_client_security, client_security
from kvstore.errors import ConfigError
from kvstore.memory import tune_malloc

# subcommand -> (module in kvstore.bench, help)
COMMANDS = {
    "throughput": ("throughput.throughput_bench", "put/get GB/s per data path vs memcpy, raw disk, raw gRPC"),
    "overlap": ("engine.overlap", "layer-wise load vs serial on a real model (CPU)"),
    "replay": ("replay.replay_bench", "trace replay: admission and eviction policies vs Belady"),
    "crash": ("durability.crash", "SIGKILL the server under load, restart, check invariants"),
    "restart": ("durability.restart_bench", "directory and index recovery time for N pages"),
    "crossover": ("engine.crossover", "fetch vs recompute on this machine, with the planner's predictions"),
    "lookup": ("lookup.lookup_bench", "directory lookup latency and rate of a 512-page prefix, idle and while demoting"),
    "calls": ("callpath.callpath_bench", "a unary call from a thread and from a loop: the call socket's channels vs the runtime hop vs gRPC"),
    "checkpoint": ("engine.checkpoint", "KV checkpoint policies: SSD bytes vs tokens to recompute after a crash"),
    "fuzz": ("fuzz.fuzz_bench", "random and mutated requests on every RPC with auth + TLS on: no crash, INTERNAL, hang, leak; still exact"),
    "soak": ("soak.soak_bench", "N clients of 2 tenants, mixed ops with TLS + auth, bytes checked; RSS, p50/p99; cost vs plain"),
    "vllm": ("vllm.vllm_bench", "TTFT with a kvstore hit vs recompute vs vLLM's prefix cache; small-hit cost in the connector"),
    "cluster": ("cluster.cluster_bench", "cluster mode on loopback: remote get GB/s per data plane vs raw pumps, sharded lookup, failover"),
    "vllm-stall": ("vllm.vllm_stall", "a big hit loaded in the step vs fetched beside it (async load): decode stall, TTFT"),
    "pd": ("pd.pd_bench", "disaggregated prefill on two vLLM engines: TTFT colocated / pool / direct, handoff vs bytes / link + fixed"),
    "migrate": ("migrate.migrate_bench", "live migration of a growing session: catch-up curve vs S0 / (copy - growth) per link cap, the pause"),
    "chaos": ("chaos.run", "random traffic on 3 nodes under random faults, every history checked against a model"),
}


def _exit_on_sigterm() -> None:
    """SIGTERM (kill, a CI timeout) ends a run as Ctrl-C does: its finally blocks stop the
    servers, load processes and writers it started. Python's default died without them and
    left them running (a lookup run's floor dd wrote on until the disk was full)."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def _command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names; None for none, or one it cannot tell (then every bench is
    imported, as ``--help`` does: it lists them all, and an error is the full parser's to report)."""
    probe = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    probe.add_argument("--log-level")
    add_client_security(probe)
    sub = probe.add_subparsers(dest="command")
    for name in COMMANDS:
        sub.add_parser(name, add_help=False)
    if {"-h", "--help"} & set(argv[: next((i for i, a in enumerate(argv) if a in COMMANDS), len(argv))]):
        return None
    try:
        return probe.parse_known_args(argv)[0].command  # type: ignore[no-any-return]
    except (argparse.ArgumentError, SystemExit):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore-bench", description="kvstore benchmarks against physical limits",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--log-level", default="warning")
    # Read into args.token and args.tls for subcommands that reach a server with --auth-file/TLS;
    # today's subcommands start their own loopback server without them and do not use them.
    add_client_security(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    command = _command(sys.argv[1:] if argv is None else argv)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        if command not in (None, name):  # a run imports its own bench only (each import of them all cost a second)
            continue
        module = importlib.import_module(f"kvstore.bench.{module_name}")
        module.add_arguments(p)
        p.add_argument("--json", action="store_true", help="end with one JSON object")
        p.set_defaults(module=module)
    args = parser.parse_args(argv)
    try:
        args.token, args.tls = client_security(args)
    except ConfigError as exc:
        parser.error(str(exc))
    logs.setup(args.log_level)
    tune_malloc()  # as the server does; see kvstore.memory
    _exit_on_sigterm()
    report = args.module.run(args)
    args.module.print_table(report)
    if args.json:
        print(json.dumps(report))
    return 1 if report.get("num_violations") else 0


def run_alone(module: ModuleType, argv: list[str] | None) -> None:
    """``python -m kvstore.bench.<module>`` of a bench that also runs without the server's
    client flags (cluster_balance, cluster_transport): its arguments, ``--json``, its table."""
    name = module.__spec__.name if module.__spec__ else module.__name__  # "__main__" run with -m
    parser = argparse.ArgumentParser(prog=f"python -m {name}", description=(module.__doc__ or "").splitlines()[0])
    module.add_arguments(parser)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = module.run(args)
    module.print_table(report)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    exit_now(main())
