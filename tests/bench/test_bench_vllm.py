"""Smoke run of kvstore-bench vllm on a real (tiny) vLLM engine."""

from __future__ import annotations

import json
import subprocess
import sys


def test_vllm_smoke(tmp_path) -> None:
    """kvstore-bench vllm on a real (tiny) vLLM engine: every mode runs, the kvstore hit
    really comes from kvstore, the small hits load, the PNG is written."""
    res = subprocess.run(
        [sys.executable, "-m", "kvstore.bench.main", "vllm", "--prompt-tokens", "128", "--suffix-tokens", "8", "--layers", "2",
         "--hidden", "128", "--kv-heads", "2", "--head-dim", "64", "--block-size", "32", "--repeats", "1",
         "--small-repeats", "2", "--json", "--dir", str(tmp_path / "vl"), "--plot", str(tmp_path / "vl.png")],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    by = {r["mode"]: r for r in report["ttft"]}
    assert list(by) == ["recompute", "vllm-prefix-cache", "kvstore-hit", "kvstore-load-all"]
    assert by["recompute"]["num_cached_tokens"] == 0
    assert by["vllm-prefix-cache"]["num_cached_tokens"] == by["kvstore-load-all"]["num_cached_tokens"] == 128
    # the cost model's arm loads what it measures to be worth it: all of it, or less on a slow or busy machine
    assert by["kvstore-hit"]["num_cached_tokens"] in range(0, 129, 32)
    assert [(r["pages"], r["calls"]) for r in report["small_hits"]] == [
        (1, "call socket"), (16, "call socket"), (1, "gRPC"), (16, "gRPC")]
    assert all(r["total_ms"] > 0 and r["memcpy_ms"] > 0 for r in report["small_hits"])
    assert (tmp_path / "vl.png").stat().st_size > 1000
