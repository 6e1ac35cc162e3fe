"""Per-tenant quotas (DESIGN §11): what one tenant may make the server hold.

A tenant's limits are the server-wide defaults (--tenant-* flags, ``TenantQuota``) with the
auth file's ``[quotas.TENANT]`` over them, re-read with the file (SIGHUP). Its use is read
from counters the holders keep anyway: the directory's bytes per namespace and tier and
its remote records, the lease table's leases, allocations and slot bytes per owner (a
tenant's: owners.owner_for), the token log's tokens per namespace, the hints in hint_charges.py.

More: kvstore/server/tenancy/README.md (### quotas.py).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

from kvstore.config import TenantQuota
from kvstore.directory import Directory
from kvstore.errors import HostQuotaFull, QuotaExceeded
from kvstore.security.identity import Identity
from kvstore.server.leases import LeaseTable
from kvstore.server.metrics import Metrics
from kvstore.server.tenancy.hint_charges import HintCharges
from kvstore.server.tenancy.owners import NamespaceOwners, owner_for
from kvstore.server.tokenlog import TokenLog
from kvstore.types import REMOTE_TIER

TOKEN_BYTES = 4  # a logged token is a little-endian uint32
_ALL_USES = frozenset(("host_bytes", "ssd_bytes", "leases", "allocations", "hints", "token_log_bytes", "published_records",
                       "ssd_written_bytes", "call_connections"))
_PER_NAMESPACE = frozenset(("host_bytes", "ssd_bytes", "token_log_bytes", "published_records"))  # summed over its namespaces


class Reservation:
    """What one call reserved of its tenant's quotas; ``release`` once the change it guards
    is counted by its holder, or failed (idempotent)."""

    def __init__(self, release: Callable[[], None] | None = None, tenant: str = "",
                 amounts: dict[str, int] | None = None) -> None:
        self._release = release
        self.tenant, self.amounts = tenant, amounts or {}  # what ``Quotas.handing_over`` gives back itself

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def taken(self) -> bool:
        """Marks it released without giving anything back (the caller does); False if it was."""
        release, self._release = self._release, None
        return release is not None


NOTHING = Reservation()


class Quotas:
    def __init__(self, defaults: TenantQuota, overrides: Callable[[], dict[str, dict[str, int]]], owners: NamespaceOwners,
                 directory: Directory, leases: LeaseTable, wal: TokenLog, hint_grace_s: float, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic, call_connections: Callable[[str], int] = lambda tenant: 0) -> None:
        self.defaults = defaults
        self._overrides = overrides
        self.owners = owners
        self.directory = directory
        self._leases = leases
        self._wal = wal
        self._hint_grace_s = hint_grace_s
        self.metrics = metrics or Metrics()
        self._clock = clock
        self._hints = HintCharges(clock)
        self._cache: tuple[object, dict[str, TenantQuota]] = (None, {})
        self._locks: dict[str, threading.Lock] = {}
        self._reserved: dict[str, Counter[str]] = {}  # tenant -> quota -> reserved by its calls in flight
        self.ssd_written: Counter[str] = Counter()  # tenant -> ssd device bytes written for it (ssd_share.py)
        self.call_connections = call_connections  # tenant -> its call socket connections (kvstore/callsocket/socket_server.py: TenantConnections)

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

    def usage(self, tenant: str, names: Collection[str] | None = None) -> dict[str, int]:
        """What ``tenant`` holds, by TenantQuota field (host_bytes: pages and allocated slots),
        and the ssd bytes written for it (``ssd_written_bytes``); only ``names`` when given
        (a call reserving leases alone reads two counters, not every namespace's usage under
        the directory's lock: the cost of tenancy per call)."""
        wanted = _ALL_USES if names is None else names
        slot_bytes = self._leases.slot_bytes(owner_for(tenant)) if "host_bytes" in wanted else 0  # before the directory: a commit moves bytes from one to the other
        held: dict[str, int] = {}
        tokens = 0
        if not _PER_NAMESPACE.isdisjoint(wanted):
            logged = "token_log_bytes" in wanted
            for namespace_id in self.owners.namespaces_of(tenant):
                for what, amount in self.directory.usage(namespace_id).items():
                    held[what] = held.get(what, 0) + amount
                if logged:
                    tokens += self._wal.tokens_of(namespace_id)
        leases, allocations = self._leases.held(owner_for(tenant))
        every = {"host_bytes": held.get("host", 0) + slot_bytes, "ssd_bytes": held.get("ssd", 0), "leases": leases,
                 "allocations": allocations, "token_log_bytes": tokens * TOKEN_BYTES,
                 "published_records": held.get(REMOTE_TIER, 0), "ssd_written_bytes": self.ssd_written[tenant]}
        if "hints" in wanted:
            every["hints"] = self._hints.held(tenant)
        if "call_connections" in wanted:
            every["call_connections"] = self.call_connections(tenant)
        return every if names is None else {name: every[name] for name in names}

    def refused(self, tenant: str, quota: str) -> None:
        self.metrics.tenant_quota_refusals.labels(tenant, quota).inc()

    def call_connection_limit(self, who: Identity) -> int:
        """How many call socket connections ``who``'s tenant may hold (0: no limit, as for the local tenant)."""
        return self.limits(who.tenant).call_connections if self._bounded(who) else 0

    @staticmethod
    def _bounded(who: Identity) -> bool:
        return who.via != "local"

    def _lock(self, tenant: str) -> threading.Lock:
        lock = self._locks.get(tenant)  # no Lock made per call only to be thrown away
        return lock if lock is not None else self._locks.setdefault(tenant, threading.Lock())

    # -- reservations --------------------------------------------------------------------

    def reserve(self, who: Identity, **amounts: int) -> Reservation:
        """Checks and reserves ``amounts`` (TenantQuota field -> how much the call adds) in one
        step; QuotaExceeded, reserving nothing, when one would pass its limit. HostQuotaFull
        (a QuotaExceeded) when only host_bytes would, and evicting the tenant's own pages down
        to its ``keep_bytes`` would make room."""
        if not self._bounded(who):
            return NOTHING
        tenant = who.tenant
        limits = self.limits(tenant)
        checked = [name for name in amounts if getattr(limits, name)]  # 0: no limit, no use to read
        with self._lock(tenant):
            used = self.usage(tenant, checked)
            reserved = self._reserved.setdefault(tenant, Counter())
            for name in checked:
                adding, limit = amounts[name], getattr(limits, name)
                held = used[name] + reserved[name]
                if held + adding > limit:
                    self._refuse(who, name, adding, held, limit, used)
            reserved.update(amounts)
        return Reservation(lambda: self._give_back(tenant, amounts), tenant, amounts)

    def hold(self, who: Identity, **amounts: int) -> Reservation:
        """Reserves ``amounts`` without a check: a change moving use from one holder's count to
        another's (a commit: slots to pages) is counted throughout."""
        if not self._bounded(who):
            return NOTHING
        with self._lock(who.tenant):
            self._reserved.setdefault(who.tenant, Counter()).update(amounts)
        return Reservation(lambda: self._give_back(who.tenant, amounts), who.tenant, amounts)

    @contextmanager
    def reserving(self, who: Identity, **amounts: int) -> Iterator[None]:
        """``reserve`` for the body, released after it (its change is counted by then)."""
        held = self.reserve(who, **amounts)
        try:
            yield
        finally:
            held.release()

    @contextmanager
    def handing_over(self, held: Reservation) -> Iterator[None]:
        """For the body that makes the holder count what ``held`` reserved (an allocation's
        slots and its place in the lease table; a commit's pages in the directory): it runs under the tenant's lock, and ``held``
        is released in the same step, so a call checking meanwhile sees the change once. Else
        it is counted twice for a moment, and a call of the tenant that fits was refused (its
        keep_bytes negative: no room to make). A body that raises releases nothing here."""
        if not held.amounts:
            yield
            return
        with self._lock(held.tenant):
            yield
            if held.taken():
                self._reserved[held.tenant].subtract(held.amounts)

    def _give_back(self, tenant: str, amounts: dict[str, int]) -> None:
        with self._lock(tenant):
            self._reserved[tenant].subtract(amounts)

    def _refuse(self, who: Identity, name: str, adding: int, held: int, limit: int, used: dict[str, int]) -> None:
        """Raises; counts the refusal unless the caller may make room (HostQuotaFull: it counts
        one if it still fails after)."""
        refused = QuotaExceeded(who.tenant, name, held, adding, limit)
        if name == "host_bytes":
            keep = limit - adding - (held - used["host_bytes"]) - self._leases.slot_bytes(owner_for(who.tenant))
            if keep >= 0:  # evicting its own pages down to keep makes room (slots and reservations cannot go)
                raise HostQuotaFull(refused, keep)
        self.refused(who.tenant, name)
        raise refused

    # -- the quotas, as the servicers use them -------------------------------------------

    def pages(self, who: Identity, num_pages: int, page_bytes: int) -> Reservation:
        """For an allocation of ``num_pages`` new pages: one allocation and their host bytes,
        held until the allocation holds its slots (``LeaseTable.slot_bytes``)."""
        return self.reserve(who, allocations=1, host_bytes=num_pages * page_bytes)

    def lease(self, who: Identity) -> Reservation:
        return self.reserve(who, leases=1)

    def publish(self, who: Identity, num_records: int) -> Reservation:
        return self.reserve(who, published_records=num_records)

    @contextmanager
    def appending(self, who: Identity) -> Iterator[Callable[[int], None]]:
        """A token append: gives the token log the charge it calls, under its own lock, with
        the tokens the append adds (none for a retry of an applied append)."""
        held: list[Reservation] = []

        def charge(num_tokens: int) -> None:
            if num_tokens:
                held.append(self.reserve(who, token_log_bytes=num_tokens * TOKEN_BYTES))

        try:
            yield charge
        finally:
            for reservation in held:  # the token log counts the tokens by now, or wrote none
                reservation.release()

    @contextmanager
    def hinting(self, who: Identity, entries: list[tuple[list[bytes], float]]) -> Iterator[None]:
        """Charges the hinted keys of ``entries`` ((keys, eta_s)) until their eta plus the hint
        grace, or their use; a body that raises (the server refused the Hint) charges nothing."""
        if not self._bounded(who):
            yield
            return
        now = self._clock()
        try:
            ids = self._hints.charge(who.tenant, [(keys, now + eta + self._hint_grace_s) for keys, eta in entries],
                                     self.limits(who.tenant).hints)
        except QuotaExceeded:
            self.refused(who.tenant, "hints")
            raise
        try:
            yield
        except BaseException:
            self._hints.refund(ids)
            raise

    def used(self, who: Identity, keys: list[bytes]) -> None:
        """``who`` read ``keys``: the hints that announced these uses are fulfilled."""
        if self._bounded(who) and keys:
            self._hints.used(who.tenant, keys)
