"""The tenancy gate's directory operations (Lookup, Publish, Remove, Invalidate, Subscribe,
Quarantine, Stats): a mixin of ``Gate`` (gate.py), apart because they touch records, not pages."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from kvstore import validate
from kvstore.directory import Event, EventKind
from kvstore.errors import InvalidRequest
from kvstore.security.identity import Identity, Rights
from kvstore.server.placement import Placement
from kvstore.server.stats import CoreStats
from kvstore.server.tenancy.access import Tenancy
from kvstore.server.tenancy.cluster_reads import ClusterReads
from kvstore.server.tenancy.node_calls import acting_for, require_node
from kvstore.server.tenancy.owners import owner_for
from kvstore.server.tenancy.room import CallContext
from kvstore.tiers.base import Quarantined, TierUsage
from kvstore.types import LocationRun

if TYPE_CHECKING:  # cluster mode is imported only when the server runs it
    from kvstore.server.cluster import ClusterRuntime

SUBSCRIBE_POLL_S = 0.5
Record = tuple[bytes, str, str, int]  # key, node, tier, size_bytes
TenantUse = tuple[str, dict[str, int], dict[str, int]]  # a tenant, what it holds and its limits, by TenantQuota field


class DirectoryGate:
    """Needs ``core``, ``tenancy``, ``cluster`` and ``cluster_reads`` of the gate it is mixed into."""

    core: Placement
    tenancy: Tenancy
    cluster: ClusterRuntime | None
    cluster_reads: ClusterReads | None

    def _admitting(self, nodes: list[str], epoch: int, owner_epoch: int) -> AbstractContextManager[None]:
        """A node's calls name its epoch and the one of this node it heard of: a call of an
        incarnation that is over, or to one, is refused."""
        return self.cluster.incarnations.admitting(nodes, epoch, owner_epoch) if self.cluster is not None else nullcontext()

    def lookup(self, who: Identity, ns: bytes, keys: list[bytes], local_only: bool, tenant: str,
               context: CallContext) -> tuple[list[LocationRun], int]:
        """The runs of ``keys`` the caller may see, and the generation read before them (runs of an
        older one are never labelled newer); with ``local_only`` or ``tenant``: a node asking a shard owner."""
        generation = self.core.directory.generation(ns)
        if local_only or tenant:
            require_node(who, "Lookup with local_only or tenant")
            if not self.tenancy.may_read(acting_for(who, tenant), ns):
                return [], 0  # answered with no generation
            runs = self.cluster.owner_lookup(ns, keys) if self.cluster is not None else self.core.directory.lookup(ns, keys)
        elif self.cluster_reads is not None:
            runs = self.cluster_reads.lookup(who, ns, keys, context.time_remaining())
        elif self.tenancy.may_read(who, ns):
            runs = self.core.directory.lookup(ns, keys)  # the directory's lock only
        else:
            runs = []  # as for an empty namespace
        return runs, generation

    def publish(self, who: Identity, ns: bytes, records: Callable[[], list[Record]], tenant: str, generation: int | None,
                epoch: int, owner_epoch: int) -> list[int]:
        """A node's records, for ``tenant`` (bound here to it, within its quota); ``records``
        validates them once the node right is checked, ``generation`` is unvalidated."""
        require_node(who, "Publish")
        checked = records()
        who = acting_for(who, tenant)
        entered = validate.generation(generation) if generation is not None else None
        if entered is not None:  # a newer one than this node's: entered here first (the sender learned it from etcd)
            self.core.enter_generation(ns, entered)
        with self.tenancy.quotas.reserving(who, published_records=len(checked)), self.tenancy.writing(who, ns), \
                self._admitting([r[1] for r in checked], epoch, owner_epoch):
            return self.core.publish_remote(ns, checked, entered)

    def remove(self, who: Identity, ns: bytes, keys: list[bytes], tier: str, node: str, epoch: int, owner_epoch: int) -> int:
        """With ``node``: a node withdrawing its records from a shard owner."""
        if node:
            require_node(who, "Remove with node")
            with self._admitting([node], epoch, owner_epoch):
                return self.core.withdraw_remote(ns, node, keys, tier)
        if not self.tenancy.may_administer(who, ns):
            return 0  # as for an empty namespace
        return self.core.remove(ns, keys, tier)

    def invalidate(self, who: Identity, ns: bytes, keys: list[bytes], generation: int, context: CallContext) -> tuple[int, int]:
        """Pages removed and the namespace's generation after. With ``generation`` (unvalidated):
        a node that raised it in etcd, telling this one."""
        if generation:
            require_node(who, "Invalidate with a generation")
            removed = self.core.enter_generation(ns, validate.generation(generation)) or 0
            return removed, self.core.directory.generation(ns)
        if keys and self.cluster is not None:
            raise InvalidRequest("Invalidate with keys is local to one node, and another node's copy would be fetched "
                                 "straight back: in cluster mode invalidate the whole namespace (no keys; its generation "
                                 "goes up at every node)")
        if not (self.tenancy.may_administer(who, ns) or self._elsewhere(who, ns)):  # as for an empty namespace
            return 0, self.core.directory.generation(ns)
        if self.cluster is not None:  # etcd first, then every member, before this answers
            return self.cluster.invalidate(ns, context.time_remaining())
        return self.core.invalidate(ns, keys), self.core.directory.generation(ns)

    def _elsewhere(self, who: Identity, namespace_id: bytes) -> bool:
        """Cluster mode: a tenant's namespace bound to nobody at this node may be its own at
        another (it wrote there): it may invalidate it here. Its id folds in the tenant's
        secret salt, so another tenant cannot name it without a leak."""
        return self.cluster is not None and who.via != "local" and self.tenancy.owners.owner(namespace_id) is None

    def events(self, who: Identity, from_seq: int, context: CallContext) -> Iterator[Event]:
        """The directory's events from ``from_seq`` (0: the next one) of the namespaces ``who``
        sees, and every RESYNC, while the caller listens and the directory is open."""
        sees = self.tenancy.sees
        events = self.core.directory.events
        next_seq = from_seq or events.last_seq + 1
        while context.is_active() and not events.closed:
            for ev in events.wait_since(next_seq, SUBSCRIBE_POLL_S):
                if ev.kind == EventKind.RESYNC or sees(who, ev.namespace_id):
                    yield ev
                next_seq = max(next_seq, ev.seq + 1)

    def quarantine(self, who: Identity, purge: bool) -> tuple[list[Quarantined], int]:
        """The quarantined pages ``who`` sees, and how many a purge (the admin right) removed."""
        if purge:
            self.tenancy.check_purge(who)
        pages = [q for q in self.core.quarantined() if self.tenancy.sees(who, q.namespace_id)]
        return pages, self.core.purge_quarantine() if purge else 0

    def stats(self, who: Identity) -> tuple[CoreStats, list[TenantUse]]:
        """An admin's: the node's figures and every tenant's use. Another caller's: only its own
        (``_own_stats``), never the server-wide hit, eviction and SSD-budget counters, which would
        tell it how busy the other tenants are."""
        if not who.allows(Rights.ADMIN):
            return self._own_stats(who), [self._use(who.tenant)]
        return self.core.stats(), [self._use(t) for t in self.tenancy.tenants()]

    def _use(self, tenant: str) -> TenantUse:
        return tenant, self.tenancy.quotas.usage(tenant), vars(self.tenancy.quotas.limits(tenant))

    def _own_stats(self, who: Identity) -> CoreStats:
        """The pages and bytes of the caller's own namespaces in each of this node's tiers (and the
        tiers' capacities, the operator's public figures), its leases, its quarantined pages and the
        event sequence it subscribes from. Not a hot path: it walks its namespaces' directory entries."""
        directory = self.core.directory
        pages: dict[str, int] = {}
        used: dict[str, int] = {}
        num_entries = 0
        for namespace_id in self.tenancy.owners.namespaces_of(who.tenant):
            for key in directory.keys_of(namespace_id):
                entry = directory.get(key)
                if entry is None:
                    continue
                num_entries += 1
                for loc in list(entry.locations.values()):
                    if loc.node == self.core.node:
                        pages[loc.tier] = pages.get(loc.tier, 0) + 1
                        used[loc.tier] = used.get(loc.tier, 0) + loc.size_bytes
        tiers = {name: TierUsage(pages.get(name, 0), used.get(name, 0), usage.capacity_bytes)
                 for name, usage in self.core.reporter.usages().items()}
        quarantined = sum(1 for q in self.core.quarantined() if self.tenancy.sees(who, q.namespace_id))
        return CoreStats(self.core.node, num_entries, directory.events.last_seq, tiers,
                         self.core.leases.held(owner_for(who.tenant))[0], quarantined)
