"""Per-tenant quotas (DESIGN §11): what one tenant may make the server hold.

A tenant's limits are the server-wide defaults (--tenant-* flags, ``TenantQuota``) with the
auth file's ``[quotas.TENANT]`` over them, re-read with the file (SIGHUP). Its use is read
from counters the holders keep anyway: the directory's bytes per namespace and tier and
its remote records, the lease table's leases and allocations per tenant, the token log's
tokens per namespace, and the hints charged here until their eta plus grace. A check is a
few dict reads per namespace of the tenant; nothing is written per RPC.

Checks run before the request changes anything and raise LimitExceeded (RESOURCE_EXHAUSTED)
for that tenant only. They are not atomic with the change they guard: concurrent calls of
one tenant can pass a limit by at most what those calls add. The local tenant of a server
without tenants has no quota.

A tenant at its host_bytes quota makes room by evicting (writing down) its own coldest
pages (``Placement.evict_own``); it is refused only when all of them are pinned. Demotion
does not check ssd_bytes: a tenant at its ssd_bytes limit is refused new pages instead.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable

from kvstore.config import TenantQuota
from kvstore.directory import Directory
from kvstore.errors import HostQuotaFull, LimitExceeded
from kvstore.security.identity import Identity
from kvstore.server.leases import LeaseTable
from kvstore.server.tenancy.owners import NamespaceOwners
from kvstore.server.tokenlog import TokenLog
from kvstore.types import REMOTE_TIER

TOKEN_BYTES = 4  # a logged token is a little-endian uint32


class _HintCharges:
    """Hinted keys charged to each tenant until their eta plus grace (a consumed hint stays
    charged until then: conservative, and nothing to hook into the eviction order)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._due: list[tuple[float, str, int]] = []  # (until, tenant, keys)
        self._held: dict[str, int] = {}

    def held(self, tenant: str) -> int:
        with self._lock:
            self._expire()
            return self._held.get(tenant, 0)

    def charge(self, tenant: str, num_keys: int, until: float, limit: int) -> None:
        with self._lock:
            self._expire()
            held = self._held.get(tenant, 0)
            if limit and held + num_keys > limit:
                raise LimitExceeded(f"tenant {tenant!r} holds {held} hinted keys; {num_keys} more would pass its quota "
                                    f"of {limit} (hints); nothing was hinted")
            self._held[tenant] = held + num_keys
            heapq.heappush(self._due, (until, tenant, num_keys))

    def _expire(self) -> None:
        now = self._clock()
        while self._due and self._due[0][0] <= now:
            _, tenant, num_keys = heapq.heappop(self._due)
            self._held[tenant] -= num_keys


class Quotas:
    def __init__(self, defaults: TenantQuota, overrides: Callable[[], dict[str, dict[str, int]]], owners: NamespaceOwners,
                 directory: Directory, leases: LeaseTable, wal: TokenLog, hint_grace_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.defaults = defaults
        self._overrides = overrides
        self._owners = owners
        self._directory = directory
        self._leases = leases
        self._wal = wal
        self._hint_grace_s = hint_grace_s
        self._clock = clock
        self._hints = _HintCharges(clock)
        self._cache: tuple[object, dict[str, TenantQuota]] = (None, {})

    def limits(self, tenant: str) -> TenantQuota:
        overrides = self._overrides()
        table, cache = self._cache
        if table is not overrides:  # the auth file was reloaded
            cache = {}
            self._cache = (overrides, cache)
        found = cache.get(tenant)
        if found is None:
            found = cache[tenant] = TenantQuota(**{**vars(self.defaults), **overrides.get(tenant, {})})
        return found

    def tenants_with_limits(self) -> list[str]:
        return list(self._overrides())

    def usage(self, tenant: str) -> dict[str, int]:
        """What ``tenant`` holds, by TenantQuota field."""
        held: dict[str, int] = {}
        tokens = 0
        for namespace_id in self._owners.namespaces_of(tenant):
            for what, amount in self._directory.usage(namespace_id).items():
                held[what] = held.get(what, 0) + amount
            tokens += self._wal.tokens_of(namespace_id)
        leases, allocations = self._leases.held(tenant)
        return {"host_bytes": held.get("host", 0), "ssd_bytes": held.get("ssd", 0), "leases": leases,
                "allocations": allocations, "hints": self._hints.held(tenant), "token_log_bytes": tokens * TOKEN_BYTES,
                "published_records": held.get(REMOTE_TIER, 0)}

    @staticmethod
    def _bounded(who: Identity) -> bool:
        return who.via != "local"

    def _over(self, who: Identity, name: str, adding: int, used: int | None = None) -> None:
        limit = getattr(self.limits(who.tenant), name)
        if not limit:
            return
        if used is None:
            used = self.usage(who.tenant)[name]
        if used + adding > limit:
            raise LimitExceeded(f"tenant {who.tenant!r} holds {used} {name.replace('_', ' ')}; {adding} more would pass "
                                f"its quota of {limit} (--tenant-{name.replace('_', '-')} or the auth file's quotas); "
                                "nothing was done")

    def check_pages(self, who: Identity, num_pages: int, page_bytes: int) -> None:
        """Before an allocation of ``num_pages`` pages: allocations, the ssd share (a tenant
        whose ssd_bytes are spent takes no new page: it would be demoted), and host bytes
        (HostQuotaFull: the caller may evict the tenant's own pages and ask again)."""
        if not self._bounded(who):
            return
        used = self.usage(who.tenant)
        self._over(who, "allocations", 1, used["allocations"])
        self._over(who, "ssd_bytes", 1 if used["ssd_bytes"] else 0, used["ssd_bytes"])
        try:
            self._over(who, "host_bytes", num_pages * page_bytes, used["host_bytes"])
        except LimitExceeded as exc:
            keep = self.limits(who.tenant).host_bytes - num_pages * page_bytes
            if keep < 0:  # the request alone is larger than the quota
                raise
            raise HostQuotaFull(str(exc), keep) from None

    def check_durable(self, who: Identity, num_bytes: int) -> None:
        """Before a durable commit writes ``num_bytes`` through to the ssd tier."""
        if self._bounded(who):
            self._over(who, "ssd_bytes", num_bytes)

    def check_lease(self, who: Identity) -> None:
        if self._bounded(who):
            self._over(who, "leases", 1, self._leases.held(who.tenant)[0])

    def check_tokens(self, who: Identity, num_tokens: int) -> None:
        if self._bounded(who):
            self._over(who, "token_log_bytes", num_tokens * TOKEN_BYTES)

    def check_publish(self, who: Identity, num_records: int) -> None:
        if self._bounded(who):
            self._over(who, "published_records", num_records)

    def charge_hints(self, who: Identity, num_keys: int, eta_s: float) -> None:
        """Charges ``num_keys`` hinted keys until ``eta_s`` (from now) plus the hint grace."""
        if self._bounded(who):
            limit = self.limits(who.tenant).hints
            self._hints.charge(who.tenant, num_keys, self._clock() + eta_s + self._hint_grace_s, limit)
