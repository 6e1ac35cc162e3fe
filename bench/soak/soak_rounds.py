"""The cost of TLS + auth measured in interleaved rounds (kvstore-bench soak --rounds).

More: bench/soak/README.md (### soak_rounds.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from statistics import median
from typing import Any

RunPhase = Callable[[str, argparse.Namespace], "dict[str, Any]"]  # (phase name, round arguments) -> the phase's summary


def pairs(names: list[str]) -> list[tuple[str, str]]:
    """(baseline, compared) for every comparison the named phases allow, in a fixed order."""
    found = []
    for transport in ("shm", "grpc"):
        for part in ("secure", "tls", "auth"):
            if f"plain-{transport}" in names and f"{part}-{transport}" in names:
                found.append((f"plain-{transport}", f"{part}-{transport}"))
    if "plain-shm" in names and "local-shm" in names:
        found.append(("plain-shm", "local-shm"))
    return found


def round_args(args: argparse.Namespace) -> argparse.Namespace:
    """The soak's arguments for one round: its own short warm-up and measurement, no plot."""
    return argparse.Namespace(**{**vars(args), "warmup_s": args.round_warmup_s, "duration_s": args.round_s, "plot": None})


def run(run_phase: RunPhase, names: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every pair's rounds, by the compared phase's name."""
    per_round = round_args(args)
    results: dict[str, dict[str, Any]] = {}
    for baseline, compared in pairs(names):
        ops: dict[str, list[float]] = {baseline: [], compared: []}
        evicting: dict[str, list[Any]] = {baseline: [], compared: []}  # (evictions per put, tokens found) per round
        cpu: dict[str, list[Any]] = {baseline: [], compared: []}  # (server, clients) CPU ms per op per round
        errors = wrong = 0
        samples: list[str] = []  # the first few errors, by phase
        order = []
        for i in range(args.rounds):
            first, second = (baseline, compared) if i % 2 == 0 else (compared, baseline)
            order.append(first)
            for name in (first, second):
                summary = run_phase(name, per_round)
                ops[name].append(summary["ops_per_s"])
                host = summary.get("host_tier") or {}
                evicting[name].append([host.get("evictions_per_put"), host.get("tokens_found_measured")])
                used = summary.get("cpu") or {}
                cpu[name].append([used.get("server_ms_per_op"), used.get("clients_ms_per_op")])
                errors += summary["counts"].get("errors", 0) + (not summary["server_alive"])
                wrong += summary["counts"].get("wrong_bytes", 0)
                samples += [f"{name}: {e}" for e in summary["error_samples"][: 5 - len(samples)]]
            print(f"soak: round {i + 1}/{args.rounds} {baseline} {ops[baseline][-1]} ops/s, "
                  f"{compared} {ops[compared][-1]} ops/s", file=sys.stderr)
        results[compared] = {**summarize(baseline, compared, ops[baseline], ops[compared], order, errors, wrong, args),
                             "baseline_evictions_per_put_tokens_found": evicting[baseline],
                             "phase_evictions_per_put_tokens_found": evicting[compared],
                             "baseline_cpu_ms_per_op": cpu[baseline], "phase_cpu_ms_per_op": cpu[compared],
                             "cpu_per_op_increase": cpu_increase(cpu[baseline], cpu[compared]), "error_samples": samples}
    return results


def summarize(baseline: str, compared: str, base_ops: list[float], other_ops: list[float], order: list[str],
              errors: int, wrong: int, args: argparse.Namespace) -> dict[str, Any]:
    """The slowdown of ``compared`` vs ``baseline``: median of the per-round-pair ratios, min, max."""
    slowdowns = [round(b / o - 1, 4) for b, o in zip(base_ops, other_ops) if o > 0]
    return {
        "baseline": baseline, "phase": compared, "rounds": len(base_ops), "round_s": args.round_s,
        "round_warmup_s": args.round_warmup_s, "first_in_round": order,
        "baseline_ops_per_s": base_ops, "phase_ops_per_s": other_ops, "slowdowns": slowdowns,
        "slowdown_median": round(median(slowdowns), 4) if slowdowns else None,
        "slowdown_min": min(slowdowns) if slowdowns else None, "slowdown_max": max(slowdowns) if slowdowns else None,
        "errors": errors, "wrong_bytes": wrong,
    }


def cpu_increase(base: list[list[Any]], other: list[list[Any]]) -> dict[str, float | None]:
    """Median over round pairs of how much more CPU an op took on the compared side, for the
    server and for the clients (soak_cpu.py: steadier than ops/s on a shared machine)."""
    found: dict[str, float | None] = {}
    for i, side in enumerate(("server", "clients")):
        ratios = [o[i] / b[i] - 1 for b, o in zip(base, other) if b[i] and o[i]]
        found[side] = round(median(ratios), 4) if ratios else None
    return found


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=6,
                   help="after the phases: interleaved round pairs per comparison for the cost of TLS + auth (0: none)")
    p.add_argument("--round-s", type=float, default=10.0, help="measured seconds of one round")
    p.add_argument("--round-warmup-s", type=float, default=5.0, help="seconds of one round before its measurement")


def total_s(names: list[str], args: argparse.Namespace) -> float:
    """Seconds the rounds take (for the progress bar), server starts aside."""
    return len(pairs(names)) * args.rounds * 2 * (args.round_warmup_s + args.round_s)


def violations(rounds: dict[str, dict[str, Any]]) -> list[str]:
    return [f"rounds {r['baseline']} vs {name}: {r['errors']} errors, {r['wrong_bytes']} wrong bytes: {r.get('error_samples', [])[:3]}"
            for name, r in rounds.items() if r["errors"] or r["wrong_bytes"]]


def line(r: dict[str, Any]) -> str:
    """One line of the table: the median and its spread."""
    if r["slowdown_median"] is None:
        return f"{r['phase']} vs {r['baseline']}: no rounds"
    evicting = ", ".join(f"{side} {_median_of(r.get(f'{key}_evictions_per_put_tokens_found', []), 0)} evictions per put, "
                         f"{_median_of(r.get(f'{key}_evictions_per_put_tokens_found', []), 1)} of tokens found"
                         for side, key in ((r["baseline"], "baseline"), (r["phase"], "phase")))
    return (f"{r['phase']} vs {r['baseline']} in {r['rounds']} interleaved round pairs of {r['round_s']:.0f} s: "
            f"median {r['slowdown_median']:+.1%} ops/s (min {r['slowdown_min']:+.1%}, max {r['slowdown_max']:+.1%}); "
            f"medians: {evicting}; CPU per op: {_cpu_words(r.get('cpu_per_op_increase'))}")


def _cpu_words(increase: dict[str, float | None] | None) -> str:
    if not increase:
        return "not measured"
    return ", ".join(f"{side} {'n/a' if v is None else f'{v:+.1%}'}" for side, v in increase.items()) + " (median of round pairs)"


def _median_of(rounds: list[list[Any]], i: int) -> float | None:
    values = [r[i] for r in rounds if r[i] is not None]
    return round(median(values), 3) if values else None
