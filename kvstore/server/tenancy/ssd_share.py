"""A tenant's share of the ssd tier (DESIGN §11): its ``ssd_bytes`` and its share of the write
budget (``ssd_write_percent``), asked by the mover (kvstore/server/placement/shares.py) with
the core's lock held, for durable writes and demotions alike.

More: kvstore/server/tenancy/README.md (### ssd_share.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container

from kvstore.server.admission import WriteBudget
from kvstore.server.placement.moves import NotAmong
from kvstore.server.tenancy.quotas import Quotas


class SsdShares:
    """Implements placement's TenantShares. Not thread-safe: the core's lock is held."""

    def __init__(self, quotas: Quotas, budget: WriteBudget | None, tier_name: str = "ssd") -> None:
        self.quotas = quotas
        self.budget = budget  # the drive's: a tenant's bucket is a share of its rate and burst
        self.tier_name = tier_name
        self._buckets: dict[str, tuple[int, WriteBudget]] = {}  # tenant -> (its percent, its bucket)
        self._placing: dict[bytes, tuple[str, int]] = {}  # key being written -> (tenant, bytes)
        self._pending: Counter[str] = Counter()  # tenant -> bytes being written

    def tenant_of(self, namespace_id: bytes) -> str | None:
        return self.quotas.owners.owner(namespace_id)

    def over(self, tenant: str, num_bytes: int) -> bool:
        limit = self.quotas.limits(tenant).ssd_bytes
        if not limit:
            return False
        held = sum(self.quotas.directory.usage(ns).get(self.tier_name, 0) for ns in self.quotas.owners.namespaces_of(tenant))
        return held + self._pending[tenant] + num_bytes > limit

    def own(self, tenant: str, pinned: Container[bytes]) -> Container[bytes]:
        return NotAmong(pinned, self.quotas.directory, self.quotas.owners.namespaces_of(tenant))

    def _bucket(self, tenant: str) -> WriteBudget | None:
        percent = self.quotas.limits(tenant).ssd_write_percent
        if not percent or self.budget is None or self.budget.unlimited:
            return None
        found = self._buckets.get(tenant)
        if found is None or found[0] != percent:  # new, or its share changed with the auth file
            share = percent / 100
            found = self._buckets[tenant] = (percent, WriteBudget(self.budget.rate_bps * share, self.budget.burst_bytes * share,
                                                                  self.budget.clock))
        return found[1]

    def can_write(self, tenant: str, cost: int) -> bool:
        bucket = self._bucket(tenant)
        if bucket is None or bucket.can_take(cost):
            return True
        bucket.refused_bytes += cost
        return False

    def wrote(self, tenant: str, cost: int) -> None:
        bucket = self._bucket(tenant)
        if bucket is not None:
            bucket.take(cost)
        self.quotas.ssd_written[tenant] += cost
        self.quotas.metrics.tenant_ssd_written.labels(tenant).inc(cost)

    def placing(self, key: bytes, tenant: str, num_bytes: int) -> None:
        self._placing[key] = (tenant, num_bytes)
        self._pending[tenant] += num_bytes

    def placed(self, key: bytes) -> None:
        found = self._placing.pop(key, None)
        if found is not None:
            self._pending[found[0]] -= found[1]

    def refused(self, tenant: str, quota: str) -> None:
        self.quotas.refused(tenant, quota)
