"""How bench/chaos/converge.py measures the convergence time after a heal, without a cluster: a
Convergence whose reads are scripted per (round, node, check) and whose clock is stepped by each
read. The time is per check (node, prefix): when the read that began its last run of passes
ended, the latest over the checks; it never falls below a pass that a later failure undid."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvstore.bench.chaos import converge
from kvstore.bench.chaos.converge import Convergence, Prefix

P1, P2 = Prefix("t", "ns", 0, 64, 1), Prefix("t", "ns", 1, 0, None)


def scripted(monkeypatch: pytest.MonkeyPatch, fails: dict[tuple[int, str, Prefix], bool],
             nodes: tuple[str, ...] = ("n1", "n2")) -> tuple[Convergence, list[float]]:
    """Each read takes 1 s of a fake clock; ``fails[(round, node, prefix)]``: that read fails."""
    conv = Convergence.__new__(Convergence)
    conv.durable, conv.samples, conv.nodes, conv.wrong = [P1], [P2], list(nodes), {}
    clock = [0.0]
    rounds = [0]

    async def read(node: str, prefix: Prefix, whole: bool) -> str | None:
        clock[0] += 1.0
        return f"{prefix.root} at {node}" if fails.get((rounds[0], node, prefix)) else None

    real_round = conv._round

    async def counted_round(passing: dict) -> list[str]:  # type: ignore[type-arg]
        try:
            return await real_round(passing)
        finally:
            rounds[0] += 1

    async def no_sleep(_: float) -> None:
        return None

    monkeypatch.setattr(conv, "_read", read)
    monkeypatch.setattr(conv, "_round", counted_round)
    monkeypatch.setattr(converge, "time", SimpleNamespace(monotonic=lambda: clock[0]))  # the module's own names only
    monkeypatch.setattr(converge, "asyncio", SimpleNamespace(sleep=no_sleep))
    return conv, clock


def test_a_check_that_passes_fails_and_passes_again_converged_at_its_second_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 reads a round (2 nodes x 2 checks), 1 s each: round r's reads end at 4r+1 .. 4r+4
    # n2's P1 passed in round 0 (t=3), failed in round 1, passes from round 2 (t=11); n1's P1 from round 1 (t=5)
    fails = {(0, "n1", P1): True, (1, "n2", P1): True}
    conv, _ = scripted(monkeypatch, fails)
    took, violations = asyncio.run(conv.wait(0.0, deadline_s=100.0, late_s=200.0))
    assert took == 11.0 and violations == []


def test_the_latest_check_to_pass_sets_the_time_not_the_rounds_end(monkeypatch: pytest.MonkeyPatch) -> None:
    fails = {(0, "n1", P1): True, (1, "n1", P1): True}  # n1's P1 passes at round 2's first read (t=9)
    conv, _ = scripted(monkeypatch, fails)
    took, violations = asyncio.run(conv.wait(0.0, deadline_s=100.0, late_s=200.0))
    assert took == 9.0 and violations == []  # the clean round ended at t=12


def test_late_and_never_are_reported_from_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    fails = {(r, "n2", P2): True for r in range(3)}  # passes from round 3 on: t=16, past a 10 s deadline
    conv, _ = scripted(monkeypatch, fails)
    took, violations = asyncio.run(conv.wait(0.0, deadline_s=10.0, late_s=200.0))
    assert took == 16.0 and [v.check for v in violations] == ["b/c"]
    conv, _ = scripted(monkeypatch, {(r, "n1", P1): True for r in range(100)})
    took, violations = asyncio.run(conv.wait(0.0, deadline_s=10.0, late_s=20.0))
    assert took is None and [v.check for v in violations] == ["b"]
