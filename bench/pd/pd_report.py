"""The rows, goals, table and PNG of ``kvstore-bench pd`` (pd.py measures)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

SLACK = 1.2  # DESIGN §12.7: direct handoff <= 1.2 x bytes / link + 5 ms
ALLOWANCE_S = 0.005


def _median(xs: list[float]) -> float:
    ordered = sorted(xs)
    return ordered[len(ordered) // 2]


def _arm(samples: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    """Medians of one PD arm's samples, keys prefixed with the arm's name."""
    moved = sum(s["bytes"] for s in samples) / 1e9
    out = {f"{prefix}_ttft_s": _median([s["ttft_s"] for s in samples]),
           f"{prefix}_second_s": _median([s["second_s"] for s in samples]),
           f"{prefix}_handoff_s": _median([s["handoff_s"] for s in samples])}
    for key in ("prefill_s", "stored_after_prefill_s", "complete_start_s", "complete_end_s", "wait_start_s", "get_s",
                "decode_after_get_s"):
        out[f"{prefix}_{key}"] = _median([s[key] for s in samples])
    out[f"{prefix}_gbps"] = samples[0]["bytes"] / out[f"{prefix}_handoff_s"] / 1e9 if out[f"{prefix}_handoff_s"] > 0 else None
    for group in samples[0]["cpu_s"]:
        out[f"{prefix}_{group}_cpu_s_per_gb"] = sum(s["cpu_s"][group] for s in samples) / moved if moved else None
    out[f"{prefix}_num_cached_tokens"] = min(s["num_cached_tokens"] for s in samples)  # the decode's hit: the bench checks it
    out[f"{prefix}_handoff_s_each"] = [s["handoff_s"] for s in samples]
    out[f"{prefix}_ttft_s_each"] = [s["ttft_s"] for s in samples]
    out[f"{prefix}_second_s_each"] = [s["second_s"] for s in samples]
    return out


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    def r(v: Any) -> Any:
        if isinstance(v, float):
            return round(v, 6)
        return [r(x) for x in v] if isinstance(v, list) else v
    return {k: r(v) for k, v in row.items()}


def _goal_s(nbytes: int, link_gbps: float) -> float:
    return SLACK * nbytes / (link_gbps * 1e9) + ALLOWANCE_S


def summarize(args: argparse.Namespace, lengths: list[int], bytes_per_token: int, link: dict[str, Any],
              measured: dict[str, Any]) -> dict[str, Any]:
    """The rows and goals. Each direct handoff is judged against the link round run just before it
    (``link_gbps`` of its sample); a row's link is the median of its handoffs' rounds."""
    page_bytes = args.block_size * bytes_per_token
    one_page = _median([s["handoff_s"] for s in measured["fixed"]])
    fixed_s = _median([s["handoff_s"] - page_bytes / (s["link_gbps"] * 1e9) for s in measured["fixed"]])
    rows = []
    for tokens in lengths:
        arms = measured["samples"][tokens]
        nbytes = arms["direct"][0]["bytes"]
        link_bps = _median([s["link_gbps"] for s in arms["direct"]]) * 1e9
        row: dict[str, Any] = {"tokens": tokens, "bytes": nbytes,
                               "colocated_ttft_s": _median([s["ttft_s"] for s in arms["colocated"]]),
                               "colocated_ttft_s_each": [s["ttft_s"] for s in arms["colocated"]],
                               "colocated_second_s": _median([s["second_s"] for s in arms["colocated"]]),
                               "colocated_second_s_each": [s["second_s"] for s in arms["colocated"]]}
        row |= _arm(arms["pool"], "pool") | _arm(arms["direct"], "direct")
        row["handoff_s"] = row["direct_handoff_s"]
        row["gbps"] = row["direct_gbps"]
        row["link_gbps"] = link_bps / 1e9
        row["link_gbps_each"] = [s["link_gbps"] for s in arms["direct"]]
        row["handoff_over_goal_each"] = [s["handoff_s"] / _goal_s(nbytes, s["link_gbps"]) for s in arms["direct"]]
        row["handoff_over_goal"] = _median(row["handoff_over_goal_each"])
        row["link_bound_s"] = nbytes / link_bps
        row["model_handoff_s"] = nbytes / link_bps + fixed_s
        row["handoff_vs_model"] = row["handoff_s"] / row["model_handoff_s"] if row["model_handoff_s"] > 0 else None
        row["handoff_goal_s"] = _goal_s(nbytes, link_bps / 1e9)
        row["ttft_goal_s"] = row["colocated_ttft_s"] + row["handoff_s"]
        row["second_goal_s"] = row["colocated_second_s"] + row["handoff_s"]
        for point in ("ttft", "second"):  # paired: each repeat's direct request against the colocated one run beside it
            excess = [d[f"{point}_s"] - c[f"{point}_s"] - d["handoff_s"] for c, d in zip(arms["colocated"], arms["direct"], strict=True)]
            row[f"direct_{point}_excess_s_each"] = excess
            row[f"direct_{point}_excess_s"] = _median(excess)
        rows.append(_rounded(row))
    goals: dict[str, bool] = {}
    for row in rows:
        goals[f"direct_handoff<=1.2x_link+5ms@{row['tokens']}"] = row["handoff_over_goal"] <= 1.0
        goals[f"direct_ttft<=colocated+handoff@{row['tokens']}"] = row["direct_ttft_excess_s"] <= 0
        goals[f"direct_second<=colocated+handoff@{row['tokens']}"] = row["direct_second_excess_s"] <= 0
    return {"rows": rows, **link, "fixed_s": round(fixed_s, 6), "one_page_handoff_s": round(one_page, 6),
            "one_page_handoff_s_each": [round(s["handoff_s"], 6) for s in measured["fixed"]], "page_bytes": page_bytes,
            "bytes_per_token": bytes_per_token, "model": {"layers": args.layers, "hidden": args.hidden, "kv_heads": args.kv_heads,
                                                          "head_dim": args.head_dim, "dtype": "float32", "block_size": args.block_size},
            "chunk_tokens": args.chunk_tokens or None, "push_layers": args.push_layers, "data_plane": args.data_plane, "repeats": args.repeats, "goals": goals,
            "all_goals_met": all(goals.values()), "definitions": DEFINITIONS}


DEFINITIONS = {
    "handoff_s": "CLOCK_MONOTONIC from the end of the prefill connector's last layer-wise save of the prompt (the prefill "
                 "node acknowledged the commit of its last page) to the return of the decode connector's handoff_wait with "
                 "every page (the completion marker set at the decode node); the same points in the pool and direct arms. With "
                 "--chunk-tokens the last page may be stored before the prefill's last chunk ends, and Complete waits for "
                 "the request's end: the handoff then includes that chunk (complete_start_s shows it). Through the pool "
                 "nothing orders the two: the pages are findable once published, before the prefill's engine hears its last "
                 "commit answered, so pool_handoff_s may read <= 0 on a loaded host (its pool_gbps is then null)",
    "ttft_s": "colocated: from the decode engine's generate call (a T-token prompt, 2 tokens) to the step that gave its first "
              "token; pool/direct: from the prefill engine's generate call to its first token, which kvstore-pd-proxy streams "
              "at once (no HTTP proxy hop in either)",
    "second_s": "colocated: to the step that gave its second token; pool/direct: from the prefill engine's generate call to "
                "the decode engine's first token, generated from the prompt + the prefill's token (its handed-off pages "
                "loaded, only that token computed)",
    "model_handoff_s": "bytes / the row's link_gbps + fixed_s (median over the 1-page direct handoffs of its time - its "
                       "bytes / its link). A row's link_gbps: the median of the raw TCP pump's rounds run just before each of "
                       "its direct handoffs (the report's top-level link_gbps: the rounds at the start)",
    "goals": "direct handoff <= 1.2 x bytes / link + 5 ms, each handoff against its own round of the pump (the median of "
             "handoff_over_goal_each <= 1); TTFT and the second token paired per repeat (the colocated and the direct "
             "request of one repeat run back to back, the arms taking turns going first): the median over the repeats of "
             "direct - colocated - that direct request's handoff_s (direct_ttft_excess_s, direct_second_excess_s) <= 0. "
             "ttft_goal_s / second_goal_s: the same comparison of the arms' medians, unpaired, for reference",
    "pool": "through the pool here is the prefill node's own host tier, pulled once by the decode node (one transfer), not "
            "the chapter's third-party pool (write + read, two transfers)",
    "cpu_s_per_gb": "user + system CPU seconds (/proc) of the two nodes, and of the two engines (prefill compute included), "
                    "over each PD request, per GB handed off",
}


def _num(value: float | None, spec: str) -> str:
    """A figure, or "-" where none was measured (a GB/s of a handoff that took no time: through the
    pool the decode's wait may return before the prefill's engine hears its last commit answered)."""
    return "-" if value is None else format(value, spec)


def _ms(seconds: float | None) -> str:
    return _num(None if seconds is None else seconds * 1e3, ".1f")


def print_table(report: dict[str, Any]) -> None:
    m = report["model"]
    print(f"vLLM CPU, random Llama {m['layers']} layers, {m['kv_heads']} KV heads x {m['head_dim']}, fp32: "
          f"{report['bytes_per_token']} B/token, {m['block_size']}-token pages ({report['page_bytes'] / 2**20:.2f} MiB); "
          f"data plane {report['data_plane']}; prefill chunks {report['chunk_tokens'] or 'none'}; layers pushed ahead {report.get('push_layers', 'on')}; load average {report.get('load_average_1m')}")
    print(f"raw link (TCP pump, same sockets, page messages): {report['link_gbps']:.2f} GB/s at the start, "
          f"{report['link_cpu_s_per_gb']:.3f} CPU s/GB, and a round before each direct handoff (a row's: 'link'); "
          f"fixed cost (1-page direct handoff - its bytes/link): {report['fixed_s'] * 1e3:.2f} ms")
    print(f"medians of {report['repeats']}; handoff: prefill's last page stored -> decode's handoff_wait returned")
    print("TTFT and the second token (ms from the request): colocated / through the pool / direct")
    print(f"{'tokens':>6} {'MiB':>7} {'TTFT':>24} {'second token':>24} | {'hand pool':>9} {'hand dir':>9} "
          f"{'model':>7} {'x model':>7} {'x goal':>6} {'link':>5} {'GB/s':>6} {'pool':>6} | {'nodes s/GB':>10} {'engines s/GB':>12}")
    for r in report["rows"]:
        ttft = " / ".join(f"{r[f'{arm}_ttft_s'] * 1e3:.1f}" for arm in ("colocated", "pool", "direct"))
        second = " / ".join(f"{r[f'{arm}_second_s'] * 1e3:.1f}" for arm in ("colocated", "pool", "direct"))
        print(f"{r['tokens']:>6} {r['bytes'] / 2**20:>7.1f} {ttft:>24} {second:>24} | {_ms(r['pool_handoff_s']):>9} {_ms(r['handoff_s']):>9} "
              f"{_ms(r['model_handoff_s']):>7} {_num(r['handoff_vs_model'], '.2f'):>7} {_num(r['handoff_over_goal'], '.2f'):>6} "
              f"{_num(r['link_gbps'], '.2f'):>5} {_num(r['gbps'], '.2f'):>6} {_num(r['pool_gbps'], '.2f'):>6} | "
              f"{_num(r['direct_nodes_cpu_s_per_gb'], '.3f'):>10} {_num(r['direct_engines_cpu_s_per_gb'], '.2f'):>12}")
    print("direct, where the time goes (ms after the last page stored): complete called / answered, decode's wait called; "
          "then the lease (or get) of the pages, the decode's step with the copy into the blocks")
    for r in report["rows"]:
        print(f"{r['tokens']:>6}: complete {r['direct_complete_start_s'] * 1e3:.1f} / {r['direct_complete_end_s'] * 1e3:.1f}, "
              f"wait {r['direct_wait_start_s'] * 1e3:.1f}, handoff {r['handoff_s'] * 1e3:.1f}; get {r['direct_get_s'] * 1e3:.1f}, "
              f"decode {r['direct_decode_after_get_s'] * 1e3:.1f}; prefill {r['direct_prefill_s'] * 1e3:.1f} "
              f"(last page stored {r['direct_stored_after_prefill_s'] * 1e3:.1f} after it answered)")
    print("paired per repeat (ms): direct - colocated - its handoff; the goals ask the median <= 0")
    for r in report["rows"]:
        each = ", ".join(f"{x * 1e3:+.1f}" for x in r["direct_ttft_excess_s_each"])
        print(f"{r['tokens']:>6}: TTFT {r['direct_ttft_excess_s'] * 1e3:+.1f} ({each}); "
              f"second token {r['direct_second_excess_s'] * 1e3:+.1f}")
    print("goals: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in report["goals"].items()))


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    mib = [r["bytes"] / 2**20 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style in (("handoff_s", "direct", "o-"), ("pool_handoff_s", "through the pool", "s-")):
        ax.plot(mib, [r[key] * 1e3 for r in rows], style, label=f"{label} (measured)")
    ax.plot(mib, [r["model_handoff_s"] * 1e3 for r in rows], "k--", label="model: bytes / link + fixed")
    ax.plot(mib, [r["handoff_goal_s"] * 1e3 for r in rows], ":", color="grey", label="goal: 1.2 x bytes / link + 5 ms")
    ax.set_xlabel("bytes handed off (MiB)")
    ax.set_ylabel("handoff time (ms)")
    links = ", ".join(f"{r['link_gbps']:.2f}" for r in rows)
    ax.set_title(f"prefill -> decode handoff, raw link {links} GB/s (each size's), fixed {report['fixed_s'] * 1e3:.1f} ms",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
