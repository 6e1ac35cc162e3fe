"""The raw link of ``kvstore-bench pd``: the cluster bench's TCP pump kept running for the whole
run, measured in rounds at the start (GB/s and CPU per GB) and again one round just before each
direct handoff, so that a handoff is judged against the link of its own minute (on a shared host
the pump moved 2.9-6.1 GB/s between runs minutes apart)."""

from __future__ import annotations

from typing import Any

from kvstore.bench.cluster.cluster_paired import tcp_pump
from kvstore.bench.common.proc_stat import cpu_seconds


class Link:
    def __init__(self, page_bytes: int, total: int) -> None:
        import psutil

        self.page_bytes, self.total = page_bytes, total
        self._pump = tcp_pump(page_bytes, 16, total)  # page-sized messages, 16 per request; one warm-up round
        self.round = self._pump.round  # one round of ``total`` bytes: its GB/s
        self._pids = [self._pump.proc.pid, *(c.pid for c in psutil.Process(self._pump.proc.pid).children(recursive=True))]

    def measure(self, rounds: int) -> dict[str, Any]:
        """``rounds`` in a row: the median GB/s and both pump processes' CPU seconds per GB."""
        before = sum(cpu_seconds(p) or 0.0 for p in self._pids)
        rates = [self.round() for _ in range(rounds)]
        cpu = sum(cpu_seconds(p) or 0.0 for p in self._pids) - before
        return {"link_gbps": sorted(rates)[len(rates) // 2], "link_gbps_each": rates,
                "link_cpu_s_per_gb": round(cpu / (self.total * rounds / 1e9), 4), "link_page_bytes": self.page_bytes,
                "link_round_bytes": self.total}

    def close(self) -> None:
        self._pump.close()
