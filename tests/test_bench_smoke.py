"""Smoke run of kvstore-bench throughput: every path runs, bytes verified, JSON shape as documented."""

from __future__ import annotations

import json
import subprocess
import sys


def test_throughput_smoke(tmp_path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvstore.bench.main", "throughput", "--pages", "8", "--repeats", "1", "--json", "--dir", str(tmp_path / "tp")],
        check=False, capture_output=True, text=True, timeout=300,
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
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["mode"] for r in report["results"]] == ["serial", "layerwise", "layerwise-ahead"]
    for r in report["results"]:
        assert r["seconds"] > 0 and r["ideal_seconds"] == round(max(report["t_read_s"], report["t_compute_s"]), 4)


def test_crossover_smoke(tmp_path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvstore.bench.main", "crossover", "--lengths", "64,128,256", "--layers", "2", "--hidden", "128",
         "--kv-heads", "2", "--head-dim", "32", "--link-mbps", "5,50", "--repeats", "1", "--json",
         "--dir", str(tmp_path / "cx"), "--plot", str(tmp_path / "cx.png")],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert {p["path"] for p in report["paths"]} == {"host-shm", "host-grpc", "ssd"}
    for p in report["paths"]:
        assert p["read_gbps"] > 0 and p["measured_read_ms"] > 0 and p["predicted_read_ms"] > 0
    assert [e["link_gbps"] for e in report["emulated"]] == [0.005, 0.05]
    assert report["r_gbps"] > 0 and report["chapter"]["r_gbps"] == 1.411
    assert (tmp_path / "cx.png").stat().st_size > 1000


def test_checkpoint_policies_smoke(tmp_path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvstore.bench.main", "checkpoint", "--prompt", "64", "--generate", "48", "--crashes", "1",
         "--periods", "32", "--json", "--dir", str(tmp_path / "ck")],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    by = {r["policy"]: r for r in json.loads(res.stdout.strip().splitlines()[-1])["results"]}
    assert by["ram"]["ssd_mib_per_1k_tokens"] == 0
    assert by["write-through"]["mean_tokens_to_prefill"] < by["ram"]["mean_tokens_to_prefill"]
    assert by["write-through"]["ssd_mib_per_1k_tokens"] >= by["periodic-32"]["ssd_mib_per_1k_tokens"]


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
    assert list(by) == ["recompute", "vllm-prefix-cache", "kvstore-hit"]
    assert by["recompute"]["num_cached_tokens"] == 0
    assert by["vllm-prefix-cache"]["num_cached_tokens"] == by["kvstore-hit"]["num_cached_tokens"] == 128
    assert [r["pages"] for r in report["small_hits"]] == [1, 16]
    assert all(r["total_ms"] > 0 and r["memcpy_ms"] > 0 for r in report["small_hits"])
    assert (tmp_path / "vl.png").stat().st_size > 1000
