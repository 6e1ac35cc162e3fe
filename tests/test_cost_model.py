"""The online cost model (kvstore/cost_model.py): the prior before data, convergence to a
known line from noisy observations, and the load decision on the chapter's numbers."""

from __future__ import annotations

import random

import pytest

from kvstore import cost_model as cm
from kvstore import planner

QWEN3_8B_TOKEN = planner.kv_bytes_per_token_gqa(36, 8, 128, 2)  # 144 KiB
A100_PER_TOKEN_S = 0.856 / 8192  # recompute of 8,192 tokens on an A100 at 50% of peak (FACTS 9.2.3)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_prior_before_any_observation() -> None:
    prior = cm.Line(1e-3, 1e-9)
    cost = cm.LinearCost(prior)
    assert cost.line() == prior and cost.num_observations == 0
    assert cm.fetch_prior(shared_memory=False) == cm.Line(1e-3, 1 / 1e9)
    assert cm.fetch_prior(shared_memory=True).per_unit_s == pytest.approx(1 / 5e9)
    assert cm.recompute_prior(3000).per_unit_s == pytest.approx(1 / 3000)
    # with the priors a hit loads (as before the model existed), so that it gets measured
    costs = cm.LoadCosts(QWEN3_8B_TOKEN, cm.fetch_prior(False), cm.recompute_prior(3000))
    assert costs.worth_loading(2048) == 2048


def test_converges_to_a_known_line_from_noisy_observations() -> None:
    truth = cm.Line(2e-3, 1 / 0.5e9)  # 2 ms per call, 0.5 GB/s
    rng = random.Random(7)
    cost = cm.LinearCost(cm.Line(1e-3, 1 / 5e9))  # a prior far off
    for _ in range(4000):
        units = 2 ** rng.uniform(12, 29)  # 4 KiB .. 512 MiB
        cost.observe(units, truth.seconds(units) * rng.uniform(0.8, 1.2))
    line = cost.line()
    assert line.per_unit_s == pytest.approx(truth.per_unit_s, rel=0.05)
    assert line.fixed_s == pytest.approx(truth.fixed_s, rel=0.15)
    for units in (1e5, 1e7, 3e8):
        assert cost.seconds(units) == pytest.approx(truth.seconds(units), rel=0.05)


def test_many_small_observations_do_not_wash_out_the_slope() -> None:
    """A few prefills pin the per-token slope; thousands of decode steps after them (one
    token each) refresh the fixed cost but leave the slope."""
    truth = cm.Line(0.02, 5e-4)
    cost = cm.LinearCost(cm.recompute_prior(3000))
    for tokens in (256, 1024, 2048):
        cost.observe(tokens, truth.seconds(tokens))
    for _ in range(10_000):
        cost.observe(1, truth.seconds(1))
    assert cost.line().per_unit_s == pytest.approx(truth.per_unit_s, rel=1e-6)
    assert cost.line().fixed_s == pytest.approx(truth.fixed_s, rel=1e-6)


def test_one_size_keeps_the_prior_slope_through_what_was_seen() -> None:
    prior = cm.Line(1e-3, 1e-9)
    cost = cm.LinearCost(prior)
    for seconds in (0.9, 1.1, 1.0):
        cost.observe(1e8, seconds)
    assert cost.line().per_unit_s == prior.per_unit_s
    assert cost.seconds(1e8) == pytest.approx(1.0)
    # a line through that point with the prior's slope would need a negative fixed cost:
    # through the origin instead
    fast = cm.LinearCost(cm.Line(0.0, 1e-6))
    fast.observe(1e6, 0.5)
    assert fast.line() == cm.Line(0.0, 0.5e-6)


def test_a_slope_noise_hides_is_the_priors() -> None:
    """Decode steps and one short prefill on a loaded host: the prefill measured faster than
    the decode steps. No negative (or zero) cost per token: the prior's slope, through them."""
    cost = cm.LinearCost(cm.Line(0.0, 3e-4))
    for _ in range(7):
        cost.observe(1, 0.030)
    cost.observe(40, 0.025)
    line = cost.line()
    assert line.per_unit_s == 3e-4 and line.fixed_s > 0
    cost.observe(-1, 1.0)
    cost.observe(1e3, float("nan"))
    assert cost.num_observations == 8


def test_an_estimate_not_refreshed_falls_back_to_the_prior() -> None:
    clock = Clock()
    costs = cm.LoadCosts(1000, cm.Line(1e-3, 1e-9), cm.Line(0.0, 1e-3), fetch_max_age_s=60, clock=clock)
    costs.fetch.observe(1e6, 100.0)  # a very slow link
    assert costs.worth_loading(1000) == 0
    clock.now = 59.0
    assert costs.worth_loading(1000) == 0
    clock.now = 61.0  # not loaded since, so not measured since: try again
    assert costs.fetch.line() == costs.fetch.prior
    assert costs.worth_loading(1000) == 1000


def test_the_chapter_crossover() -> None:
    """Crossover bandwidth = r (FACTS 9.5.2): on an A100 (r = 1.41 GB/s) a fetch of
    Qwen3-8B KV over 10 GbE (1.25 GB/s) loses to recompute; over 25 GB/s it wins."""
    costs = cm.LoadCosts(QWEN3_8B_TOKEN, cm.Line(0.0, 1 / 1.25e9), cm.Line(0.0, A100_PER_TOKEN_S))
    assert costs.fetch_s(8192) == pytest.approx(0.966, abs=5e-4) and costs.recompute_s(8192) == pytest.approx(0.856)
    assert costs.worth_loading(8192) == 0
    for gbps in (25, 1.5):
        costs.fetch.prior = cm.Line(0.0, 1 / (gbps * 1e9))
        assert costs.worth_loading(8192) == 8192


def test_a_per_call_cost_makes_short_hits_not_worth_loading() -> None:
    costs = cm.LoadCosts(QWEN3_8B_TOKEN, cm.Line(0.05, 1 / 25e9), cm.Line(0.0, A100_PER_TOKEN_S))  # 50 ms per call
    assert costs.worth_loading(256) == 0  # 27 ms of recompute < 51.5 ms of fetch
    assert costs.worth_loading(8192) == 8192
    assert costs.worth_loading(0) == 0 and cm.tokens_worth_loading(0, 0.0, 1.0) == 0


def test_a_size_seen_is_predicted_from_what_it_cost() -> None:
    """Real costs bend (a gRPC read of 16 MiB took 4x the 8 MiB one in kvstore-bench
    crossover): a size already seen is predicted from its own observations."""
    cost = cm.LinearCost(cm.Line(1e-3, 1e-9))
    for units, seconds in ((2 << 20, 0.012), (4 << 20, 0.012), (8 << 20, 0.016), (16 << 20, 0.069)):
        cost.observe(units, seconds)
    assert cost.seconds(16 << 20) == pytest.approx(0.069)
    assert cost.seconds(17 << 20) == pytest.approx(0.069 + cost.line().per_unit_s * (1 << 20))
    assert cost.seconds(1 << 30) == pytest.approx(cost.line().seconds(1 << 30))  # never seen: the line


def test_a_fetch_far_off_its_class_restarts_it() -> None:
    """Noise within ``restart_factor`` is averaged; an observation further off starts its
    size class again (a link that changed speed), in either direction."""
    cost = cm.LinearCost(cm.Line(1e-3, 1e-9), restart_factor=2.0)
    for seconds in (0.010, 0.015, 0.008):
        cost.observe(1e7, seconds)
    assert cost.seconds(1e7) == pytest.approx(0.011)
    cost.observe(1e7, 0.1)
    assert cost.seconds(1e7) == pytest.approx(0.1)
    cost.observe(1e7, 0.01)
    assert cost.seconds(1e7) == pytest.approx(0.01)
    with pytest.raises(ValueError):
        cm.LinearCost(cm.Line(0.0, 1e-9), restart_factor=1.0)
