"""The soak's PNG: per phase, p50 and p99 latency of each operation over time (2 s bins),
with the server's RSS on a second axis."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import quantiles
from typing import Any

BIN_S = 2.0


def plot(phases: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(phases), 1, figsize=(11, 3.2 * len(phases)), squeeze=False, sharex=True)
    for ax, (name, phase) in zip(axes[:, 0], phases.items()):
        bins: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for t, op, latency in phase["latency_samples"]:
            bins[op][int(t // BIN_S)].append(latency * 1e3)
        for op, by_bin in sorted(bins.items()):
            xs = sorted(by_bin)
            cuts = [quantiles(by_bin[x], n=100, method="inclusive") if len(by_bin[x]) > 1 else [by_bin[x][0]] * 99 for x in xs]
            line, = ax.plot([x * BIN_S for x in xs], [c[49] for c in cuts], label=f"{op} p50")
            ax.plot([x * BIN_S for x in xs], [c[98] for c in cuts], linestyle=":", color=line.get_color(), label=f"{op} p99")
        ax.axvline(phase["warmup_s"], color="grey", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("latency, ms")
        ax.set_title(f"{name}: {phase['clients']} clients, {phase['ops_per_s']} ops/s after the warm-up (grey line)")
        rss_ax = ax.twinx()
        rss_ax.plot([t for t, _, _ in phase["rss_timeline"]], [b / 2**20 for _, b, _ in phase["rss_timeline"]], color="black",
                    linewidth=1.2, label="server RSS")
        rss_ax.set_ylim(bottom=0)
        rss_ax.set_ylabel("server RSS, MiB")
        ax.legend(fontsize=7, ncol=5, loc="upper left")
    axes[-1, 0].set_xlabel("seconds since the start")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
