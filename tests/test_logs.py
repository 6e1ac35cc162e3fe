"""kvstore.logs.Throttled: a flood of refusals logs one line per kind and interval, with the count."""

from __future__ import annotations

import logging

import pytest

from kvstore.logs import Throttled


def test_a_flood_logs_one_line_per_interval_and_counts_the_rest(caplog: pytest.LogCaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("kvstore.logs.time.monotonic", lambda: clock[0])
    throttled = Throttled(logging.getLogger("t"), interval_s=10.0)
    with caplog.at_level(logging.WARNING, logger="t"):
        for _ in range(1000):
            throttled.warning("scan", "refused %s", "x")
        throttled.warning("other", "refused %s", "z")  # another kind is not held back by the flood
        clock[0] += 10.0
        throttled.warning("scan", "refused %s", "y")
    assert [r.getMessage() for r in caplog.records] == [
        "refused x", "refused z", "refused y (and 999 more like it in the last 10 s)"]
