"""A reader's report of a corrupt page costs the server a hash of that page: bounded per
tenant, so that Acquire + Release naming pages in a loop cannot make the server hash without
end (found by a review of 36c0631: 128 MiB hashed per 1 KiB request)."""

from __future__ import annotations

from kvstore.server.placement.reported import CHECKS_PER_S, ReportBudget


def test_each_tenant_has_a_few_checks_a_second() -> None:
    now = [100.0]
    budget = ReportBudget(clock=lambda: now[0])
    granted = sum(budget.take("a") for _ in range(100))
    assert granted == int(CHECKS_PER_S)
    assert budget.take("b"), "another tenant's budget is its own"
    now[0] += 0.5
    assert sum(budget.take("a") for _ in range(100)) == int(CHECKS_PER_S / 2)
    now[0] += 60
    assert sum(budget.take("a") for _ in range(100)) == int(CHECKS_PER_S), "the bucket holds no more than a second's"
