"""Smoke run of kvstore-bench calls: every way of client.calls answers, each beside the way it saves, JSON as printed."""

from __future__ import annotations

import json
import subprocess
import sys


def test_calls_smoke() -> None:
    res = subprocess.run([sys.executable, "-m", "kvstore.bench.main", "calls", "--pages", "8", "--rounds", "1", "--calls", "5",
                          "--json"], check=False, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    ways = {row["way"]: row for row in report["rows"]}
    assert len(ways) == 12
    for what in ("lookup 1 page", "lookup 8 pages", "acquire+release"):
        assert {f"{what}, thread: blocking channel", f"{what}, thread: via runtime"} <= set(ways)
    for what in ("lookup 1 page", "lookup 8 pages"):
        assert {f"{what}, loop: own channel", f"{what}, loop: via runtime", f"{what}, loop: gRPC"} <= set(ways)
    assert all(row["calls"] == 5 and 0 < row["median_ms"] <= row["p90_ms"] for row in ways.values())
