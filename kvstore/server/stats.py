"""What the tier manager reports: Stats RPC figures and Prometheus gauges."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.tiers.base import TierUsage

if TYPE_CHECKING:
    from kvstore.server.placement import TierManager


@dataclass
class ManagerStats:
    node: str
    num_entries: int
    last_seq: int
    tiers: dict[str, TierUsage]
    num_leases: int
    num_quarantined: int
    counters: dict[str, dict[str, float]] = field(default_factory=dict)
    ssd: dict[str, float] = field(default_factory=dict)


def refresh_gauges(m: TierManager) -> None:
    if m.budget is not None and m.config.ssd is not None:
        m.metrics.ssd_budget_fill.set(m.budget.fill())
        m.metrics.ssd_write_rate.set(m.budget.write_rate_bps())
        life = m.budget.projected_life_days(m.config.ssd.capacity_bytes, m.config.ssd.dwpd)
        m.metrics.ssd_life_days.set(life if life != float("inf") else -1)
    for name, usage in m.usages().items():
        m.metrics.pages.labels(name).set(usage.num_pages)
        m.metrics.used_bytes.labels(name).set(usage.used_bytes)
        m.metrics.capacity_bytes.labels(name).set(usage.capacity_bytes)


def collect_stats(m: TierManager) -> ManagerStats:
    """Called with the manager's lock held."""
    refresh_gauges(m)
    counters: dict[str, dict[str, float]] = {}
    for name in m.usages():
        counters[name] = {
            "hits": m.metrics.hits.labels(name)._value.get(),
            "misses": m.metrics.misses.labels(name)._value.get(),
            "evictions": m.metrics.evictions.labels(name)._value.get(),
            "bytes_in": m.metrics.bytes_in.labels(name)._value.get(),
            "bytes_out": m.metrics.bytes_out.labels(name)._value.get(),
        }
    ssd: dict[str, float] = {}
    if m.budget is not None and m.config.ssd is not None and m.admission is not None:
        life = m.budget.projected_life_days(m.config.ssd.capacity_bytes, m.config.ssd.dwpd)
        ssd = {
            "dwpd": m.config.ssd.dwpd,
            "budget_bytes_per_s": m.budget.rate_bps,
            "budget_fill": m.budget.fill(),
            "written_bytes": float(m.budget.written_bytes),
            "refused_bytes": float(m.metrics.ssd_refused_bytes._value.get()),
            "write_rate_bytes_per_s": m.budget.write_rate_bps(),
            "projected_life_days": life if life != float("inf") else -1.0,
        }
        for metric in m.metrics.admissions.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    ssd[f"admission.{sample.labels['decision']}.{sample.labels['reason']}"] = sample.value
    quarantined = len(m.quarantined())
    return ManagerStats(
        node=m.node, num_entries=len(m.directory), last_seq=m.directory.events.last_seq, tiers=m.usages(),
        num_leases=len(m._leases), num_quarantined=quarantined, counters=counters, ssd=ssd,
    )
