"""kvstore-bench pd's rows and table from measured samples, without engines: a pool handoff whose
wait returned before the prefill's engine heard its last commit answered (a handoff time <= 0, no
GB/s) is reported and printed, not a crash. (A fresh-clone CI run's pd smoke failed so: the table's
format of the pool's GB/s, None.)"""

from __future__ import annotations

import argparse

from kvstore.bench.pd import pd_report

PAGE_TOKENS, BYTES_PER_TOKEN = 32, 2048


def _sample(handoff_s: float, link: float | None = None) -> dict[str, object]:
    sample: dict[str, object] = {
        "ttft_s": 0.05, "second_s": 0.08, "handoff_s": handoff_s, "bytes": 64 * BYTES_PER_TOKEN, "prefill_s": 0.04,
        "stored_after_prefill_s": 0.002, "complete_start_s": 0.001, "complete_end_s": 0.003, "wait_start_s": 0.0,
        "get_s": 0.001, "decode_after_get_s": 0.02, "num_cached_tokens": 64, "cpu_s": {"nodes": 0.01, "engines": 0.1}}
    return sample if link is None else sample | {"link_gbps": link}


def test_a_pool_handoff_that_took_no_time_is_reported_and_printed(capsys) -> None:
    args = argparse.Namespace(block_size=PAGE_TOKENS, layers=2, hidden=128, kv_heads=2, head_dim=64, chunk_tokens=0,
                              push_layers="auto", data_plane="tcp", repeats=1)
    measured = {"fixed": [_sample(0.004, 2.0)],
                "samples": {64: {"colocated": [{"ttft_s": 0.05, "second_s": 0.07}], "pool": [_sample(-0.003)],
                                 "direct": [_sample(0.006, 2.0)]}}}
    report = pd_report.summarize(args, [64], BYTES_PER_TOKEN, {"link_gbps": 2.0, "link_cpu_s_per_gb": 0.3}, measured)
    (row,) = report["rows"]
    assert row["pool_handoff_s"] == -0.003 and row["pool_gbps"] is None and row["gbps"] > 0
    pd_report.print_table(report)
    out = capsys.readouterr().out
    assert "-3.0" in out and "goals:" in out
