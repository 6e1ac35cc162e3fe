"""The rows, goals, table and PNG of ``kvstore-bench migrate`` from each row's ``Trace``.

The model is the chapter's (its §9.6.2; DESIGN §12.8): the catch-up takes S0 / (c - g), with c the raw
link measured through a proxy of the row's cap in the same run and g the growth the writer
really made while the pre-copy ran; it never converges when g >= c.
"""

from __future__ import annotations

import math
from typing import Any

from kvstore.bench.migrate.migrate_row import RowSpec, Trace

CONVERGE_SLACK = 1.25   # goal: converge_s <= 1.25 x the model
PAUSE_GOAL_MS = 50.0    # goal: pause <= 50 ms for the uncapped (loopback) row


def _gbps(bps: float | None) -> float | None:
    return None if bps is None else round(bps / 1e9, 4)


def _growth_bps(trace: Trace, until_s: float) -> float:
    """The writer's real rate over [0, until_s]: bytes it stored by then less S0, per second."""
    start = trace.writes[0][1]
    done = [b for t, b in trace.writes if t <= until_s]
    return (done[-1] - start) / until_s if until_s > 0 else 0.0


def summarize_row(spec: RowSpec, trace: Trace, page_bytes: int) -> dict[str, Any]:
    s = trace.summary
    pause_ms = s["pause_ms"] if s else None
    converge_s = trace.returned_s - pause_ms / 1000 if s and pause_ms is not None else None
    window = converge_s if converge_s is not None else trace.returned_s
    growth = _growth_bps(trace, window)
    c = trace.link_bps
    model = trace.writes[0][1] / (c - growth) if c > growth else None
    first = trace.rounds[1] if len(trace.rounds) > 1 else None
    achieved = (s["round_bytes"][0] / first[0]) if s and first and first[0] > 0 else None
    copied = s["total_bytes"] if s else 0
    cpu_total = sum(trace.cpu_s.values())
    row: dict[str, Any] = {
        "cap_gbps": None if math.isinf(spec.copy_bps) else _gbps(spec.copy_bps),
        "copy_gbps": _gbps(c), "growth_gbps": _gbps(growth), "growth_set_gbps": _gbps(spec.growth_bps),
        "initial_bytes": trace.writes[0][1], "converge_s": None if converge_s is None else round(converge_s, 4),
        "model_converge_s": None if model is None else round(model, 4),
        "ratio": None if converge_s is None or model is None else round(converge_s / model, 3),
        "pause_ms": None if pause_ms is None else round(pause_ms, 2),
        "rounds": s["rounds"] if s else len(trace.rounds) - 1, "round_bytes": s["round_bytes"] if s else [],
        "total_bytes": copied, "total_s": round(trace.returned_s, 4),
        "copy_achieved_gbps": _gbps(achieved),  # the first round's page bytes / its time: kvstore's copy on the link
        "model_achieved_s": (round(trace.writes[0][1] / (achieved - growth), 4) if achieved and achieved > growth else None),
        "gbps": _gbps(copied / trace.returned_s) if copied and trace.returned_s else None,
        "cpu_s": {k: round(v, 3) for k, v in trace.cpu_s.items()},
        "cpu_s_per_gb": round(cpu_total / (copied / 1e9), 3) if copied else None,
        "cpu_s_per_gb_by_process": {k: round(v / (copied / 1e9), 3) for k, v in trace.cpu_s.items()} if copied else None,
        "link_cpu_s_per_gb": round(trace.link_cpu_s / (spec.pump_bytes / 1e9), 3),
        "writer_exhausted": trace.writer_exhausted,
        "curve": [[round(t, 4), b] for t, b in trace.curve], "round_curve": [[round(t, 4), b] for t, b in trace.rounds],
        # the first round's end with at most 2 pages left: where the curve met its floor, fenced or not
        "two_pages_left_s": next((round(t, 4) for t, b in trace.rounds[1:] if b <= 2 * page_bytes), None),
        "reason": None,
    }
    if trace.cannot_converge is not None:
        row["reason"] = f"cannot converge: {trace.cannot_converge}" + (
            "" if model is None else f" (the model converges: growth < copy; 2 pages left at {row['two_pages_left_s']} s)")
    elif model is None:
        row["reason"] = "the model never converges (growth >= copy) but the migration did"
    return row


def goals(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """Per converging row: converge_s <= 1.25 x model; per row with growth >= copy: cannot
    converge reported; the uncapped row: pause <= 50 ms."""
    out: dict[str, bool] = {}
    for r in rows:
        at = "loopback" if r["cap_gbps"] is None else f"{r['cap_gbps']}GB/s"
        if r["model_converge_s"] is None:
            out[f"cannot_converge_reported@{at}"] = r["converge_s"] is None and bool(r["reason"])
            continue
        out[f"converge<={CONVERGE_SLACK}x_model@{at}"] = (r["converge_s"] is not None
                                                          and r["converge_s"] <= CONVERGE_SLACK * r["model_converge_s"])
        if r["cap_gbps"] is None:
            out[f"pause<={PAUSE_GOAL_MS:g}ms@loopback,{r['initial_bytes'] / 2**30:.3g}GiB"] = (
                r["pause_ms"] is not None and r["pause_ms"] <= PAUSE_GOAL_MS)
    return out


def print_table(report: dict[str, Any]) -> None:
    print(f"live migration of a growing session, node a -> node b (gRPC data plane through a link proxy); "
          f"page {report['page_bytes']} bytes, growth set to {report['growth_gbps']} GB/s, "
          f"max pause {report['max_pause_ms']} ms; load average {report['load_average_1m']}\n"
          "link: a raw TCP transfer through a proxy of the cap (the model's c); kv GB/s: the first round's copy")
    print(f"{'cap GB/s':>9} {'link GB/s':>9} {'growth':>7} {'S0 MiB':>7} {'converge s':>10} {'model s':>8} {'ratio':>6} "
          f"{'pause ms':>8} {'rounds':>6} {'kv GB/s':>8} {'CPU s/GB':>8} {'link CPU s/GB':>13}")
    for r in report["rows"]:
        cap = "loopback" if r["cap_gbps"] is None else f"{r['cap_gbps']:.3f}"

        def num(v: float | None, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        print(f"{cap:>9} {r['copy_gbps']:>9.3f} {r['growth_gbps']:>7.3f} {r['initial_bytes'] / 2**20:>7.0f} "
              f"{num(r['converge_s'], '.3f'):>10} {num(r['model_converge_s'], '.3f'):>8} {num(r['ratio'], '.2f'):>6} "
              f"{num(r['pause_ms'], '.1f'):>8} {r['rounds']:>6} {num(r['copy_achieved_gbps'], '.3f'):>8} "
              f"{num(r['cpu_s_per_gb'], '.2f'):>8} {r['link_cpu_s_per_gb']:>13.2f}")
        if r["cpu_s_per_gb_by_process"]:
            print(f"{'':>9} CPU s/GB by process: " + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_s_per_gb_by_process"].items()))
        if r["reason"]:
            print(f"{'':>9} {r['reason']}")
    print("goals: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in report["goals"].items()))
    if report.get("plot"):
        print(f"plot: {report['plot']}")


def plot(report: dict[str, Any], path: str) -> None:
    """Bytes not yet copied over time per row (sampled at the target, held until the next sample;
    dots: round ends) and the model's line S0 - (c - g) t beside each; converging rows on the
    left, cannot-converge rows (a smaller session) on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stuck = [r for r in report["rows"] if r["model_converge_s"] is None]
    panels = [p for p in ([r for r in report["rows"] if r["model_converge_s"] is not None], stuck) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, rows in zip(axes[0], panels, strict=True):
        for r in rows:
            color = f"C{report['rows'].index(r) % 10}"
            label = "loopback" if r["cap_gbps"] is None else f"cap {r['cap_gbps']} GB/s"
            curve = r["curve"] or r["round_curve"]
            ax.plot([t for t, _ in curve], [b / 2**20 for _, b in curve], color=color, drawstyle="steps-post",
                    label=f"{label} (link {r['copy_gbps']} GB/s)")
            ax.plot([t for t, _ in r["round_curve"]], [b / 2**20 for _, b in r["round_curve"]], "o", color=color, ms=3)
            s0, c, g = r["initial_bytes"], r["copy_gbps"] * 1e9, r["growth_gbps"] * 1e9
            end = r["model_converge_s"] if r["model_converge_s"] is not None else r["total_s"]
            ax.plot([0, end], [s0 / 2**20, max(0.0, s0 - (c - g) * end) / 2**20], "--", color=color, lw=1)
            if r["converge_s"] is not None:
                ax.axvline(r["converge_s"], color=color, lw=0.5, ls=":")
        ax.set_xlabel("seconds since the migration started")
        ax.set_ylabel("MiB stored at the source, not yet at the target")
        ax.set_title("cannot converge (growth >= copy)" if rows is stuck else "converging (dotted: the fence)", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(f"catch-up of a session growing at {report['growth_gbps']} GB/s; dashed: the model S0 - (c - g) t")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
