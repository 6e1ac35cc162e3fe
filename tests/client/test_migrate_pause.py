"""The fence's pause budget under ``max_pause_ms`` (client/migrate.py PauseBudget): the small
last rounds, mostly fixed cost, must not shrink it below what the bulk rounds showed the link
can copy. With the last round's rate, kvstore-bench migrate's capped rows (0.1-0.4 GB/s, growth
0.02 GB/s) came within 2 pages of the end at 1.03-1.26x the model and were then given up as
CannotConverge: 1-2 pages in ~40 ms made a budget of under one 0.5 MiB page."""

from __future__ import annotations

from kvstore.client.migrate import PauseBudget

MiB = 1 << 20


def test_small_rounds_keep_the_budget_the_bulk_round_showed() -> None:
    budget = PauseBudget(64 * MiB, max_pause_ms=10)
    budget.observe(1024 * MiB, 10.0)  # the first round: 1 GiB at ~0.107 GB/s
    bulk = budget.bytes
    assert bulk >= 2 * MiB // 2  # 10 ms at 0.107 GB/s: ~1 MiB, two 0.5 MiB pages
    budget.observe(MiB // 2, 0.040)  # a round of one page, mostly fixed cost
    assert budget.bytes == bulk


def test_without_max_pause_ms_the_byte_budget_stands() -> None:
    budget = PauseBudget(64 * MiB, max_pause_ms=None)
    budget.observe(1024 * MiB, 10.0)
    assert budget.bytes == 64 * MiB
