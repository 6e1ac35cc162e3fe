"""A tenant's share of the ssd tier (DESIGN §11): its ``ssd_bytes`` and its share of the write
budget (``ssd_write_percent``), asked by the mover (kvstore/server/placement/shares.py) with
the core's lock held, for durable writes and demotions alike.

More: kvstore/server/tenancy/README.md (### ssd_share.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container

from kvstore.server.admission import WriteBudget
from kvstore.server.placement.skips import NotAmong
from kvstore.server.tenancy.quotas import Quotas


class SsdShares:
    """Implements placement's NamespaceShares: a namespace's pages count against its tenant's share
    (an unbound namespace's against none). Not thread-safe: the core's lock is held."""

    def __init__(self, quotas: Quotas, budget: WriteBudget | None, tier_name: str = "ssd") -> None:
        self.quotas = quotas
        self.budget = budget  # the drive's: a tenant's bucket is a share of its rate and burst
        self.tier_name = tier_name
        self._buckets: dict[str, tuple[int, WriteBudget]] = {}  # tenant -> (its percent, its bucket)
        self._placing: dict[bytes, tuple[str, int]] = {}  # key being written -> (tenant, bytes)
        self._pending: Counter[str] = Counter()  # tenant -> bytes being written

    def write_refused(self, namespace_id: bytes, cost: int, tier: str) -> str | None:
        tenant = self.quotas.owners.owner(namespace_id)
        if tenant is None or self._can_write(tenant, cost):
            return None
        self.quotas.refused(tenant, "ssd_write_percent")
        return f"tenant {tenant!r} has spent its share of the {tier} write budget (ssd_write_percent of --ssd-dwpd)"

    def over(self, namespace_id: bytes, num_bytes: int) -> bool:
        tenant = self.quotas.owners.owner(namespace_id)
        return tenant is not None and self._over(tenant, num_bytes)

    def own(self, namespace_id: bytes, pinned: Container[bytes]) -> Container[bytes]:
        tenant = self.quotas.owners.owner(namespace_id)
        return pinned if tenant is None else NotAmong(pinned, self.quotas.directory, self.quotas.owners.namespaces_of(tenant))

    def full(self, namespace_id: bytes, tier: str) -> str:
        tenant = self.quotas.owners.owner(namespace_id) or ""
        self.quotas.refused(tenant, "ssd_bytes")
        return (f"tenant {tenant!r} is at its ssd bytes quota and every one of its {tier} pages is in use "
                "(--tenant-ssd-bytes or the auth file's quotas)")

    def placing(self, key: bytes, namespace_id: bytes, cost: int, num_bytes: int) -> None:
        tenant = self.quotas.owners.owner(namespace_id)
        if tenant is None:
            return
        self._wrote(tenant, cost)
        self._placing[key] = (tenant, num_bytes)
        self._pending[tenant] += num_bytes

    def placed(self, key: bytes) -> None:
        found = self._placing.pop(key, None)
        if found is not None:
            self._pending[found[0]] -= found[1]

    def _over(self, tenant: str, num_bytes: int) -> bool:
        limit = self.quotas.limits(tenant).ssd_bytes
        if not limit:
            return False
        held = sum(self.quotas.directory.usage(ns).get(self.tier_name, 0) for ns in self.quotas.owners.namespaces_of(tenant))
        return held + self._pending[tenant] + num_bytes > limit

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

    def _can_write(self, tenant: str, cost: int) -> bool:
        bucket = self._bucket(tenant)
        if bucket is None or bucket.can_take(cost):
            return True
        bucket.refused_bytes += cost
        return False

    def _wrote(self, tenant: str, cost: int) -> None:
        bucket = self._bucket(tenant)
        if bucket is not None:
            bucket.take(cost)
        self.quotas.ssd_written[tenant] += cost
        self.quotas.metrics.tenant_ssd_written.labels(tenant).inc(cost)
