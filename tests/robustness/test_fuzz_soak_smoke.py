"""Smoke runs of kvstore-bench fuzz and soak: a real kvstore-server with TLS and tokens, real
client processes; the JSON shape as documented and the verdicts that must hold on any run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from kvstore.bench.fuzz.fuzz_streams import every_method
from kvstore.bench.soak import soak_rounds
from kvstore.callsocket import frames


def _bench(*args: str, timeout_s: float = 240) -> tuple[int, dict, str]:
    res = subprocess.run([sys.executable, "-m", "kvstore.bench.main", *args, "--json"], check=False, capture_output=True,
                         text=True, timeout=timeout_s)
    lines = res.stdout.strip().splitlines()
    assert lines, res.stderr[-3000:]
    return res.returncode, json.loads(lines[-1]), res.stdout


def _not_rss(violations: list[str]) -> list[str]:
    """Violations other than server RSS growth: that one is a known server defect over a short
    run (tests/server/test_fuzz_findings.py::test_refused_large_requests_do_not_pin_server_memory)."""
    return [v for v in violations if "RSS" not in v]


def test_fuzz_smoke_calls_every_rpc_and_finds_nothing(tmp_path) -> None:
    rc, report, stdout = _bench("fuzz", "--calls", "700", "--socket-calls", "500", "--dir", str(tmp_path / "fz"))
    every = {m.name for _, m in every_method()}
    assert {n for n in report["methods"] if not n.startswith("socket:")} == every, \
        "every RPC of the protos is fuzzed, taken from the descriptors"
    assert {n for n in report["methods"] if n.startswith("socket:")} == {f"socket:{m.split('.')[1]}" for m in frames.METHODS}, \
        "every method of the same-host call socket is fuzzed there too"
    assert all(m["calls"] > 0 for m in report["methods"].values())
    assert report["num_calls"] >= 700 and report["num_messages"] > report["num_calls"]  # WritePages streams many
    assert {"valid", "fields", "encoding", "random bytes"} <= set(report["strategies"])
    codes = {c for m in report["methods"].values() for c in m["codes"]}
    assert {"OK", "INVALID_ARGUMENT", "UNAUTHENTICATED"} <= codes, "valid, malformed and unauthenticated calls all happened"
    assert report["faults"] == [] and _not_rss(report["violations"]) == []
    assert report["server_exit_code"] is None and report["leases_after_release"] == 0
    assert report["acceptance"] == {"shm": [], "grpc": []}
    assert 0 < report["rss_after_warmup"]["rss"] and report["rss_growth"] is not None
    assert rc == (1 if report["num_violations"] else 0)
    assert "status codes" in stdout and "acceptance afterwards" in stdout


def test_soak_smoke_two_tenants_exact_bytes(tmp_path) -> None:
    plot = tmp_path / "soak.png"
    rc, report, stdout = _bench("soak", "--clients", "4", "--warmup-s", "1", "--duration-s", "1.5", "--prompts", "64",
                                "--host-capacity", "16",
                                "--phases", "secure-shm,plain-shm,plain-grpc,secure-grpc,local-shm",
                                "--rounds", "1", "--round-s", "0.5", "--round-warmup-s", "0.5",
                                "--dir", str(tmp_path / "sk"), "--plot", str(plot), timeout_s=480)
    assert list(report["phases"]) == ["secure-shm", "plain-shm", "plain-grpc", "secure-grpc", "local-shm"]
    assert report["auth_file_tenants"] == {"alpha": 2, "beta": 2}, "each client its own token, two tenants"
    for name, phase in report["phases"].items():
        assert phase["server_alive"], name
        assert phase["counts"]["errors"] == 0 and phase["counts"]["wrong_bytes"] == 0, (name, phase["error_samples"])
        assert phase["counts"]["verified_tokens"] > 0, name
        assert all(phase["ops"][op]["count"] > 0 for op in ("put", "lookup", "get")), name
        assert phase["shared_memory_clients"] == (4 if name.endswith("shm") else 0), name
        assert phase["rss_baseline"] and phase["rss_end"]
        assert phase["cpu"]["server_ms_per_op"] > 0 and phase["cpu"]["clients_ms_per_op"] > 0, (name, phase["cpu"])
    # Like-for-like: with auth each tenant's arena is its host_bytes quota, --host-capacity / 2;
    # together they hold what the plain server's one arena holds (16 MiB here: both evict).
    for name, phase in report["phases"].items():
        host = phase["host_tier"]
        assert host["capacity_bytes"] == 16 << 20, (name, host)
        quotas = {t: u["host_bytes_quota"] for t, u in host["tenants_end"].items() if t in ("alpha", "beta")}
        assert quotas == ({"alpha": 8 << 20, "beta": 8 << 20} if name.startswith(("secure", "local")) else {}), name
        assert host["evictions_measured"] >= 0 and host["evictions_per_put"] is not None, name
        assert 0 < host["tokens_found_measured"] <= 1 and phase["counts"]["window_lookups"] > 0, name
    assert "host tier in the measured window" in stdout and "secure-shm 16 MiB, alpha quota 8 MiB, beta quota 8 MiB" in stdout
    assert set(report["tls_auth_cost"]) == {"shm", "grpc"}
    assert "slowdown" in report["tls_auth_cost"]["shm"]["local_socket"], "the same-host path over --local-socket is costed"
    assert "tokens on --local-socket (no TLS) cost, shm" in stdout
    assert _not_rss(report["violations"]) == [] and rc == (1 if report["num_violations"] else 0)
    assert plot.stat().st_size > 10_000 and "TLS+auth cost, grpc" in stdout
    # The cost in interleaved rounds: every pair of the named phases, each side first in turn.
    assert set(report["cost_rounds"]) == {"secure-shm", "secure-grpc", "local-shm"}
    for name, rounds in report["cost_rounds"].items():
        plain = f"plain-{name.split('-')[1]}"
        assert rounds["baseline"] == plain and rounds["first_in_round"] == [plain], name  # one round (CI time): the baseline first
        assert len(rounds["baseline_ops_per_s"]) == len(rounds["phase_ops_per_s"]) == rounds["rounds"] == 1, name
        assert all(ops > 0 for ops in rounds["baseline_ops_per_s"] + rounds["phase_ops_per_s"]), name
        assert rounds["errors"] == 0 and rounds["wrong_bytes"] == 0, name
        assert rounds["slowdown_min"] <= rounds["slowdown_median"] <= rounds["slowdown_max"], name
        assert len(rounds["baseline_evictions_per_put_tokens_found"]) == len(rounds["phase_evictions_per_put_tokens_found"]) == 1
        assert len(rounds["baseline_cpu_ms_per_op"]) == len(rounds["phase_cpu_ms_per_op"]) == 1
        assert set(rounds["cpu_per_op_increase"]) == {"server", "clients"}
    for entry in (report["tls_auth_cost"]["shm"], report["tls_auth_cost"]["grpc"], report["tls_auth_cost"]["shm"]["local_socket"]):
        assert entry["meets_goal_by"] == "rounds median"
        assert entry["meets_goal"] == (entry["rounds"]["slowdown_median"] <= entry["goal_slowdown"])
    assert "secure-grpc vs plain-grpc in 1 interleaved round pairs" in stdout
    assert "CPU per op in the measured window (soak_cpu.py): secure-shm server " in stdout


def test_soak_rounds_cost_is_the_median_of_per_pair_slowdowns() -> None:
    """One noisy round pair moves min or max, not the cost."""
    args = argparse.Namespace(round_s=10.0, round_warmup_s=5.0)
    r = soak_rounds.summarize("plain-shm", "secure-shm", [100.0, 100.0, 50.0], [100.0, 90.0, 100.0],
                              ["plain-shm", "secure-shm", "plain-shm"], 0, 0, args)
    assert r["slowdowns"] == [0.0, 0.1111, -0.5]
    assert (r["slowdown_median"], r["slowdown_min"], r["slowdown_max"]) == (0.0, -0.5, 0.1111)
    assert soak_rounds.pairs(["secure-shm", "plain-shm", "local-shm", "plain-grpc", "tls-grpc"]) == [
        ("plain-shm", "secure-shm"), ("plain-grpc", "tls-grpc"), ("plain-shm", "local-shm")]


def test_soak_help_shows_defaults_and_refuses_unknown_phases() -> None:
    shown = subprocess.run([sys.executable, "-m", "kvstore.bench.main", "soak", "--help"], check=True, capture_output=True,
                           text=True, timeout=120).stdout
    assert "(default: 16)" in shown and "(default: 60.0)" in shown, "--clients and --duration-s show their defaults"
    bad = subprocess.run([sys.executable, "-m", "kvstore.bench.main", "soak", "--phases", "secure-shm,fast"], check=False,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "secure-shm,fast" in bad.stderr
