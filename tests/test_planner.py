"""The cost model reproduces the chapter's worked numbers (DESIGN §10)."""

from __future__ import annotations

import json

import pytest

from kvstore import planner as pl

GIB = 2**30
V = 8192 * pl.kv_bytes_per_token_gqa(36, 8, 128, 2)  # Qwen3-8B, 8K tokens, BF16
R_A100 = 0.856                                        # recompute 8,192 tokens on an A100
PCIE = 25e9


def ms(x: float) -> float:
    return x * 1e3


def test_state_sizes() -> None:
    assert pl.kv_bytes_per_token_gqa(36, 8, 128, 2) == 144 * 1024
    assert V == 1_207_959_552 == 1.125 * GIB


def test_transfer_times() -> None:
    assert ms(pl.transfer_s(V, 25e9)) == pytest.approx(48.31838208, rel=1e-9)
    assert ms(pl.transfer_s(V, 50e9)) == pytest.approx(24.2, abs=0.05)
    assert ms(pl.transfer_s(V, 7.1e9)) == pytest.approx(170, abs=0.5)        # local SSD read
    assert ms(pl.transfer_s(V, 4.2e9)) == pytest.approx(288, abs=0.5)        # local SSD write
    assert ms(2 * pl.transfer_s(V, 25e9)) == pytest.approx(96.6, abs=0.05)   # through a pool: write + read


def test_store_then_fetch_vs_recompute() -> None:
    read = pl.transfer_s(V, 25e9)
    assert pl.production_rate(V, R_A100) / 1e9 == pytest.approx(1.41, abs=0.005)
    # between 1.41 and 2.82 GB/s at least two reuses are needed; above, one is enough
    for gbps in (1.5, 2.0, 2.5, 2.8):
        t = pl.transfer_s(V, gbps * 1e9)
        assert pl.reuses_to_win(t, t, R_A100) >= 2
    t = pl.transfer_s(V, 2.85e9)
    assert pl.reuses_to_win(t, t, R_A100) == 1
    assert pl.reuses_to_win(read, read, R_A100) == 1
    assert pl.reuses_to_win(pl.transfer_s(V, 1.25e9), pl.transfer_s(V, 1.25e9), R_A100) is None   # 10 GbE: 966 ms
    assert ms(pl.transfer_s(V, 1.25e9)) == pytest.approx(966, abs=0.5)
    assert ms(pl.transfer_s(V, 4.2e9) + pl.transfer_s(V, 7.1e9)) == pytest.approx(458, abs=1)


def test_layerwise_overlap_and_buffer() -> None:
    read, new = pl.transfer_s(V, PCIE), 0.0309
    assert ms(pl.layerwise_s(36, read / 36, new / 36)) == pytest.approx(49.2, abs=0.05)
    assert pl.prefetch_buffer_bytes(PCIE, read, new) / 1e6 == pytest.approx(437, rel=0.01)
    assert pl.preload_layers(36, PCIE, read, new) == 14
    assert pl.preload_layers(36, PCIE, read, 36 * 0.000857) == 14     # 0.857 ms per layer: S_buf ≈ 437 MB
    assert pl.prefetch_buffer_bytes(PCIE, read, 36 * 0.000857) / 1e6 == pytest.approx(437, abs=0.5)
    assert ms(pl.layerwise_s(36, read / 36, new / 36, preloaded=14)) == pytest.approx(30.9, abs=0.01)
    assert pl.prefetch_buffer_bytes(PCIE, read, 0.060) == 0.0


def test_endurance() -> None:
    assert pl.ssd_write_budget_bps(3.84e12, 1) / 1e6 == pytest.approx(44.4, abs=0.05)
    assert 1.41e9 / pl.ssd_write_budget_bps(3.84e12, 1) == pytest.approx(31.7, abs=0.05)


def test_first_token_overlap() -> None:
    assert ms(pl.time_to_first_token(0.080, 0.060, 0.010)) == pytest.approx(90)
    assert ms(pl.time_to_first_token(0.080, 0.060, 0.010, overlap=False)) == pytest.approx(150)


PREFILL = pl.PrefillModel(points=((256, 0.0309), (8448, 0.887)))


def _example(network_bps: float) -> list[pl.Candidate]:
    return [
        pl.Candidate("A", queue_s=0.250, prefill=PREFILL, hbm_tokens=8192),
        pl.Candidate("B", queue_s=0.020, prefill=PREFILL, remote_tokens=8192, network_bps=network_bps, lookup_s=0.010),
    ]


def test_routing_example() -> None:
    req = pl.Request(prompt_tokens=8448, bytes_per_token=V / 8192)
    plan = pl.route(req, _example(6.25e9))
    by = {(o.candidate, o.path): o for o in plan.ranking}
    assert ms(by["A", "local-hbm"].first_token_s) == pytest.approx(281, abs=0.5)
    assert ms(by["B", "recompute"].first_token_s) == pytest.approx(907, abs=0.5)
    assert ms(by["B", "fetch"].first_token_s) == pytest.approx(282, abs=1)
    assert plan.best.candidate == "A"
    fast = pl.route(req, _example(25e9))
    assert ms({(o.candidate, o.path): o for o in fast.ranking}["B", "fetch"].first_token_s) == pytest.approx(137, abs=1)
    assert fast.best.candidate == "B" and fast.best.path == "fetch"
    fixed = 0.010 + pl.transfer_s(V, PCIE) + 0.0309
    assert pl.tie_bandwidth(V, 0.2809, fixed) / 1e9 == pytest.approx(6.30, abs=0.01)   # B ties A
    assert pl.tie_bandwidth(V, 0.907, fixed) / 1e9 == pytest.approx(1.48, abs=0.01)    # fetch ties recompute


def test_stale_location_probability() -> None:
    hit, miss = 0.080 + 0.0309, 0.080 + 0.8872
    assert ms(pl.expected_first_token_s(0.9, hit, miss)) == pytest.approx(196.5, abs=0.1)
    assert ms(pl.quantile_first_token_s(0.9, hit, miss)) == pytest.approx(967.2, abs=0.1)
    assert ms(pl.quantile_first_token_s(0.99, hit, miss)) <= 220
    cands = [pl.Candidate("A", 0.080, PREFILL, hbm_tokens=8192, hit_probability=0.05),
             pl.Candidate("B", 0.020, PREFILL)]
    req = pl.Request(8448, V / 8192)
    assert pl.route(req, cands, "latency").best.candidate == "A"      # trusts the stale picture
    assert pl.route(req, cands, "expected").best.candidate == "B"     # p = 5% < 7%: recompute on B


def test_makespan_vs_latency() -> None:
    """Both requests have half their prefix on A; B holds nothing but prefills twice as
    fast. Cache-first (latency, one request at a time) stacks both on A; the makespan
    objective splits them and the batch finishes sooner."""
    req = pl.Request(8192, 1.0)
    a = pl.Candidate("A", 0.0, pl.PrefillModel(tokens_per_s=10_000), hbm_tokens=4096)
    b = pl.Candidate("B", 0.0, pl.PrefillModel(tokens_per_s=20_000))
    assert pl.route(req, [a, b]).best.candidate == "A"
    plan = pl.route_batch([req, req], [a, b])
    assert sorted(o.candidate for o in plan.assignment.values()) == ["A", "B"]
    assert plan.makespan_s == pytest.approx(0.4096)
    stacked = 2 * 4096 / 10_000
    assert plan.makespan_s < stacked
    doc = plan.to_dict()
    assert doc["objective"] == "makespan" and doc["makespan_ms"] == pytest.approx(409.6)


def test_plan_input_roundtrip() -> None:
    doc = {"request": {"prompt_tokens": 8448, "bytes_per_token": 147456}, "objective": "latency",
           "candidates": [{"name": "A", "queue_s": 0.25, "hbm_tokens": 8192, "prefill": {"points": [[256, 0.0309], [8448, 0.887]]}}]}
    req, cands, objective = pl.request_from_dict(json.loads(json.dumps(doc)))
    assert pl.route(req, cands, objective).best.path == "local-hbm"


def test_ctl_plan(tmp_path, capsys) -> None:
    from kvstore.cli import ctl

    doc = {"request": {"prompt_tokens": 8448, "bytes_per_token": 147456}, "objective": "latency",
           "candidates": [
               {"name": "A", "queue_s": 0.25, "hbm_tokens": 8192, "prefill": {"points": [[256, 0.0309], [8448, 0.887]]}},
               {"name": "B", "queue_s": 0.02, "remote_tokens": 8192, "network_bps": 25e9, "lookup_s": 0.01,
                "prefill": {"points": [[256, 0.0309], [8448, 0.887]]}}]}
    path = tmp_path / "req.json"
    path.write_text(json.dumps(doc))
    assert ctl.main(["plan", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ranking"][0]["candidate"] == "B" and out["ranking"][0]["path"] == "fetch"
    assert out["ranking"][0]["first_token_s"] == pytest.approx(137.5, abs=1)
    path.write_text("{}")
    assert ctl.main(["plan", str(path)]) == 1
