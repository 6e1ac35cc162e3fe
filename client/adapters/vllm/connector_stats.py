"""The connector's counters as vLLM's own metrics: what the scheduler side decided (hits
found, loaded, skipped as not worth loading, probes; DESIGN §10) and what the workers did (tokens
loaded, failed loads, saves).

More: client/adapters/vllm/README.md (### connector_stats.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, cast

from prometheus_client import Counter
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvstore.client.adapters.vllm.costs import LoadStats
from kvstore.client.adapters.vllm.worker import WorkerStats

# side's counter field -> stats key (the metric is vllm:kvstore_<key>, Prometheus adds _total)
SCHEDULER_KEYS = {
    "found_tokens": "found_tokens",
    "loaded_tokens": "load_scheduled_tokens",
    "skipped_tokens": "skipped_tokens",
    "requests_skipped": "skipped_requests",
    "probes": "probes",
}
WORKER_KEYS = {
    "loaded_tokens": "loaded_tokens",
    "failed_loads": "failed_loads",
    "failed_blocks": "failed_blocks",
    "saved_tokens": "saved_tokens",
    "saves_failed": "failed_saves",
}
METRICS = {  # stats key -> what the metric counts (its Prometheus help)
    "found_tokens": "Prompt tokens kvstore held beyond vLLM's own prefix cache hit (the scheduler's lookups).",
    "load_scheduled_tokens": "Tokens of kvstore hits the scheduler had vLLM allocate and load.",
    "skipped_tokens": "Tokens of kvstore hits recomputed instead: fetching them was measured to cost more.",
    "skipped_requests": "Requests whose kvstore hit was recomputed because fetching it was measured to cost more.",
    "probes": "Hits loaded though measured to cost more, to measure them again (a size skipped 40 times in a row).",
    "loaded_tokens": "Tokens whose KV the workers loaded from kvstore into vLLM's blocks (summed over workers).",
    "failed_loads": "Loads from kvstore that failed or were cut by their deadline (their blocks are recomputed).",
    "failed_blocks": "vLLM blocks reported to vLLM as failed to load, and recomputed.",
    "saved_tokens": "Tokens whose KV the workers saved to kvstore (summed over workers).",
    "failed_saves": "Saves to kvstore that failed.",
}
PREFIX = "vllm:kvstore_"  # vLLM's connector metrics are vllm:<connector>_*; LLM.get_metrics() reads only vllm:*


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counts of one interval, keyed as ``METRICS``: ``data`` is a flat ``{key: count}``
    (absent means 0), so it crosses processes as it is. Combining never changes an
    operand: vLLM may hold the same dict elsewhere (the Prometheus logger reads it after
    the log line's accumulator took it in)."""

    def __post_init__(self) -> None:
        self.data = {key: int(count) for key, count in self.data.items() if count}

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVStoreConnectorStats:
        """Sums per key: the workers' with each other's and the scheduler's, and the steps of
        a logging interval."""
        summed = dict(self.data)
        for key, count in other.data.items():
            summed[key] = summed.get(key, 0) + count
        return KVStoreConnectorStats(summed)

    def reduce(self) -> dict[str, int | float]:
        """The interval's totals for vLLM's log line, every metric named (0 when nothing happened)."""
        return {key: self.data.get(key, 0) for key in METRICS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CounterDeltas:
    """What one side's never-reset counters (``LoadStats``, ``WorkerStats``) gained since
    the last ``take``, as stats. Called from the thread that runs the side's hooks."""

    def __init__(self, counters: LoadStats | WorkerStats) -> None:
        self._counters = counters
        self._keys = SCHEDULER_KEYS if isinstance(counters, LoadStats) else WORKER_KEYS
        assert self._keys.keys() <= {f.name for f in fields(counters)}, "a counter named in connector_stats.py is gone"
        self._last = self._read()

    def _read(self) -> dict[str, int]:
        return {name: getattr(self._counters, name) for name in self._keys}

    def take(self) -> KVStoreConnectorStats | None:
        """The counts since the last call; None when nothing was counted (vLLM sends nothing)."""
        now = self._read()
        gained = {self._keys[name]: now[name] - self._last[name] for name in now if now[name] != self._last[name]}
        self._last = now
        return KVStoreConnectorStats(gained) if gained else None


class KVStorePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per ``METRICS`` key, per engine (vLLM's labels: model_name,
    engine), registered in the front end's process; ``observe`` adds one step's counts."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Counter]] = {
            key: cast(dict[int, Counter], create_metric_per_engine(
                self._counter_cls(name=PREFIX + key, documentation=doc, labelnames=labelnames), per_engine_labelvalues))
            for key, doc in METRICS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.counters.items():
            if count := transfer_stats_data.get(key, 0):
                per_engine[engine_idx].inc(count)
