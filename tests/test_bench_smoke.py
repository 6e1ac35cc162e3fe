"""Smoke run of kvstore-bench throughput: every path runs, bytes verified, JSON shape as documented."""

from __future__ import annotations

import json
import subprocess
import sys


def test_throughput_smoke(tmp_path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvstore.bench.main", "throughput", "--pages", "8", "--repeats", "1", "--json", "--dir", str(tmp_path / "tp")],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    paths = [r["path"] for r in report["results"]]
    assert paths == ["host-shm-put", "host-shm-get", "host-grpc-put", "host-grpc-get", "ssd-put", "ssd-get"]
    for r in report["results"]:
        assert r["gbps"] > 0 and r["limit_gbps"] > 0 and abs(r["ratio"] - r["gbps"] / r["limit_gbps"]) < 0.01


def test_overlap_smoke(tmp_path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvstore.bench.main", "overlap", "--hit-tokens", "512", "--new-tokens", "16", "--layers", "2",
         "--hidden", "256", "--kv-heads", "2", "--head-dim", "64", "--repeats", "1", "--json", "--dir", str(tmp_path / "ov")],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["mode"] for r in report["results"]] == ["serial", "layerwise", "layerwise-ahead"]
    for r in report["results"]:
        assert r["seconds"] > 0 and r["ideal_seconds"] == round(max(report["t_read_s"], report["t_compute_s"]), 4)
