"""What the placement core reports: Stats RPC figures and Prometheus gauges."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.directory import Directory
from kvstore.server.admission import AdmittedTier
from kvstore.server.metrics import Metrics
from kvstore.tiers.base import Tier, TierUsage


@dataclass
class CoreStats:
    node: str
    num_entries: int
    last_seq: int
    tiers: dict[str, TierUsage]
    num_leases: int
    num_quarantined: int
    counters: dict[str, dict[str, float]] = field(default_factory=dict)
    ssd: dict[str, float] = field(default_factory=dict)


class Reporter:
    """Reads the tiers, the admission wrappers and the metrics; owns nothing."""

    def __init__(self, node: str, directory: Directory, tiers: list[Tier], lower: list[AdmittedTier], metrics: Metrics) -> None:
        self.node = node
        self.directory = directory
        self.tiers = tiers
        self.lower = lower
        self.metrics = metrics

    def usages(self) -> dict[str, TierUsage]:
        return {tier.name: tier.usage() for tier in self.tiers}

    def refresh_gauges(self) -> dict[str, float]:
        """Sets the gauges; returns the figures of the admitted tier (empty without one)."""
        figures: dict[str, float] = {}
        for target in self.lower:
            figures = target.report()
        for name, usage in self.usages().items():
            self.metrics.pages.labels(name).set(usage.num_pages)
            self.metrics.used_bytes.labels(name).set(usage.used_bytes)
            self.metrics.capacity_bytes.labels(name).set(usage.capacity_bytes)
        return figures

    def collect(self, num_leases: int, num_quarantined: int) -> CoreStats:
        """Called with the core's lock held (the budget is not thread-safe)."""
        ssd = self.refresh_gauges()
        m = self.metrics
        counters: dict[str, dict[str, float]] = {}
        for tier in self.tiers:
            name = tier.name
            counters[name] = {
                "hits": m.hits.labels(name)._value.get(),
                "misses": m.misses.labels(name)._value.get(),
                "evictions": m.evictions.labels(name)._value.get(),
                "bytes_in": m.bytes_in.labels(name)._value.get(),
                "bytes_out": m.bytes_out.labels(name)._value.get(),
            }
        return CoreStats(
            node=self.node, num_entries=len(self.directory), last_seq=self.directory.events.last_seq, tiers=self.usages(),
            num_leases=num_leases, num_quarantined=num_quarantined, counters=counters, ssd=ssd,
        )
