"""kvstore-bench lookup's goal fields and table (README: the lookup tail while demoting, against the floor).

More: bench/lookup/README.md (### lookup_report.py).
"""

from __future__ import annotations

import math
from typing import Any

from kvstore.bench.lookup.lookup_floor import CALL as FLOOR_CALL

P99_GOAL, CPU_GOAL = 1.25, 1.3


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0 or not math.isfinite(a / b):
        return None
    return a / b


def _one(rows: list[dict[str, Any]], call: str, state: str, clients: int = 1) -> dict[str, Any] | None:
    return next((r for r in rows if r["call"] == call and r["clients"] == clients and r["state"] == state), None)


def goal_fields(rows: list[dict[str, Any]]) -> None:
    """Adds the ratio and CPU fields above to the draining rows, in place."""
    floor = _one(rows, FLOOR_CALL, "draining")
    floor_idle = _one(rows, FLOOR_CALL, "idle")
    floor_ratio = _ratio(floor["p99_ms"], floor_idle["p99_ms"]) if floor and floor_idle else None
    floor_cpu = floor.get("demote_floor_cpu_s_per_gb") if floor else None
    for row in rows:
        if row["state"] != "draining":
            continue
        idle = _one(rows, row["call"], "idle", row["clients"])
        row["p99_ratio"] = _ratio(row["p99_ms"], idle["p99_ms"]) if idle else None
        if row["call"] == FLOOR_CALL:
            continue
        if row["clients"] == 1:
            row["floor_p99_ratio"] = floor_ratio
            row["ratio_over_floor"] = _ratio(row["p99_ratio"], floor_ratio)
        row["demote_floor_cpu_s_per_gb"] = floor_cpu
        row["demoter_cpu_ratio"] = _ratio(row.get("demoter_cpu_s_per_gb"), floor_cpu)  # the whole server's, lookups too
        row["demoter_threads_cpu_ratio"] = _ratio(row.get("demoter_threads_cpu_s_per_gb"), floor_cpu)  # the goal's
        per_lookup = idle.get("server_cpu_ms_per_lookup") if idle else None
        lookups = _ratio(row["lookups"] * per_lookup / 1e3, row.get("demoted_gb")) if per_lookup is not None else None
        row["lookups_cpu_s_per_gb"] = lookups
        less = row["demoter_cpu_s_per_gb"] - lookups if lookups is not None and row.get("demoter_cpu_s_per_gb") else None
        row["demoter_less_lookups_cpu_ratio"] = _ratio(less, floor_cpu)


def _x(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def print_table(report: dict[str, Any]) -> None:
    rows = report["rows"]
    print(f"lookup of a {report['pages']}-page prefix, {report['seconds']:.0f} s per run "
          f"(hashing {report['pages']} keys on the client: {report['hash_ms']:.2f} ms)")
    print("| state | call | path | clients | lookups/s | p50 ms | p99 ms | short answers | writer pages/s | demoted GB/s |"
          " p99 / idle | / floor's | CPU s/GB demoted | floor CPU s/GB | cpu_ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cpu = r.get("demoter_cpu_s_per_gb", r.get("cpu_s_per_gb"))  # the floor's row: dd's own
        print(f"| {r['state']} | {r['call']} | {r['path']} | {r['clients']} | {r['lookups_per_s']:,.0f} | {r['p50_ms']:.2f} | "
              f"{r['p99_ms']:.2f} | {r['short_answers']} | {r['writer_pages_per_s']:.0f} | {r['demoted_gb_per_s']:.2f} | "
              f"{_x(r.get('p99_ratio'))} | {_x(r.get('ratio_over_floor'))} | {_x(cpu, 3)} | "
              f"{_x(r.get('demote_floor_cpu_s_per_gb'), 3)} | {_x(r.get('demoter_cpu_ratio'))} |")
    ratios = [f"{r['call']} {r['p99_ratio']:.1f}x" for r in rows
              if r["state"] == "draining" and r["clients"] == 1 and r.get("p99_ratio") is not None]
    print(f"p99 draining / idle, one client (goal <= 2x): {', '.join(ratios)}")
    drains = [r for r in rows if r["state"] == "draining" and r["call"] != FLOOR_CALL]
    print(f"p99 ratio over the floor's, one client (goal <= {P99_GOAL}x): "
          + ", ".join(f"{r['call']} {_x(r.get('p99_ratio'))} / {_x(r.get('floor_p99_ratio'))} = "
                      f"{_x(r.get('ratio_over_floor'))}x" for r in drains if r["clients"] == 1))
    floor = _one(rows, FLOOR_CALL, "draining")
    if floor and floor.get("cpu_s_per_gb") is not None:
        print(f"demoter CPU floor: dd {floor['cpu_s_per_gb']:.3f} + xxh3 {floor['hash_cpu_s_per_gb']:.3f} = "
              f"{floor['demote_floor_cpu_s_per_gb']:.3f} s/GB; server CPU per GB demoted (goal <= {CPU_GOAL}x the floor): "
              + ", ".join(f"{r['call']} x{r['clients']} {_x(r.get('demoter_cpu_s_per_gb'), 3)} "
                          f"({_x(r.get('demoter_cpu_ratio'))}x; its demotion threads' {_x(r.get('demoter_threads_cpu_s_per_gb'), 3)}: "
                          f"{_x(r.get('demoter_threads_cpu_ratio'))}x; less its lookups' estimated "
                          f"{_x(r.get('lookups_cpu_s_per_gb'), 3)}: {_x(r.get('demoter_less_lookups_cpu_ratio'))}x)"
                          for r in drains))
    for r in drains:
        if r.get("window_inside_drain") and not r["demoted_gb_per_s"]:
            print(f"NOTE: in the draining row with {r['clients']} clients the demoter wrote nothing inside the window "
                  "(its background half runs in the idle class: the host's cores were busy); that row measures no demotion")
        if not r.get("window_inside_drain", True):
            print(f"NOTE: the draining row with {r['clients']} clients outlasted its {r['backlog_gb']:.1f} GB backlog: "
                  "raise --drain-host-capacity or lower --drain-seconds")
