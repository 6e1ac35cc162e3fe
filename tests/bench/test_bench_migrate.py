"""Smoke run of kvstore-bench migrate: tiny sessions, one capped row that converges and one whose
cap is below the growth (DESIGN §12.8: "cannot converge" reported, not looped on). Structure only:
timings on a shared CI box are reported by the bench, never asserted here."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvstore.bench.migrate import migrate_bench

pytestmark = pytest.mark.timeout(180)


def test_migrate_smoke(tmp_path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvstore.bench.main", "migrate", "--copy-gbps", "0.05,0.005", "--growth-gbps", "0.01",
         "--session", "8MiB", "--small-session", "1MiB", "--layers", "2", "--pump-s", "0.2", "--json",
         "--dir", str(tmp_path / "run"), "--plot", str(tmp_path / "migrate.png")],
        check=False, capture_output=True, text=True, timeout=170,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ERROR" not in res.stderr, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["data_plane"] == "tcp"  # through the proxy on a's data listener (--advertise-data-port)
    converged, stuck = report["rows"]
    page = report["page_bytes"]
    assert page == 2 * 2 * 8 * 128 * 2 * 16
    for row in (converged, stuck):
        for key in ("copy_gbps", "growth_gbps", "initial_bytes", "converge_s", "model_converge_s", "pause_ms", "curve",
                    "round_curve", "cpu_s", "link_cpu_s_per_gb"):
            assert key in row, key
        assert row["copy_gbps"] > 0 and row["growth_gbps"] >= 0
        assert row["curve"][0] == [0.0, row["initial_bytes"]]
    assert converged["initial_bytes"] == 8 << 20 and converged["reason"] is None
    assert converged["converge_s"] > 0 and converged["model_converge_s"] > 0 and converged["pause_ms"] > 0
    assert converged["rounds"] >= 1 and converged["total_bytes"] >= converged["initial_bytes"]
    assert converged["round_curve"][-1][1] >= 0 and converged["cpu_s_per_gb"] > 0
    assert stuck["cap_gbps"] == 0.005 and stuck["initial_bytes"] == 1 << 20
    assert stuck["converge_s"] is None and stuck["pause_ms"] is None and stuck["reason"].startswith("cannot converge")
    assert set(report["goals"]) == {"converge<=1.25x_model@0.05GB/s", "cannot_converge_reported@0.005GB/s"}
    assert report["goals"]["cannot_converge_reported@0.005GB/s"] is True
    assert report["all_goals_met"] == all(report["goals"].values())
    assert (tmp_path / "migrate.png").stat().st_size > 1000


def test_a_ucx_row_cannot_be_capped() -> None:
    """UCX's transport connects past a proxy on its listener, so a capped UCX row would not be
    capped: refused, naming what to give instead."""
    parser = argparse.ArgumentParser()
    migrate_bench.add_arguments(parser)
    with pytest.raises(SystemExit, match="--data-plane tcp"):
        migrate_bench._specs(parser.parse_args(["--data-plane", "ucx", "--copy-gbps", "0,0.1"]), 1 << 19)
    assert [s.data_plane for s in migrate_bench._specs(parser.parse_args(["--data-plane", "ucx", "--copy-gbps", "0"]),
                                                       1 << 19)] == ["ucx"]
