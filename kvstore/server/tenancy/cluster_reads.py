"""A tenant's reads in cluster mode: its namespace may be bound on the nodes it wrote at but
not (yet) on the one it reads at.

More: kvstore/server/tenancy/README.md (### cluster_reads.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.errors import PermissionDenied
from kvstore.security.identity import Identity, Rights
from kvstore.server.tenancy import Tenancy
from kvstore.server.tenancy.fetch_room import quota_landing
from kvstore.server.tenancy.node_calls import on_behalf
from kvstore.types import LocationRun

if TYPE_CHECKING:
    from kvstore.server.cluster import ClusterRuntime
    from kvstore.server.cluster.landing import Landing


class ClusterReads:
    def __init__(self, tenancy: Tenancy, cluster: ClusterRuntime) -> None:
        self.tenancy = tenancy
        self.cluster = cluster

    def _unbound_for(self, who: Identity, namespace_id: bytes) -> bool:
        """A tenant's read of a namespace nobody holds here: asked of the other nodes."""
        return who.via != "local" and who.allows(Rights.READ) and self.tenancy.owners.owner(namespace_id) is None

    def lookup(self, who: Identity, namespace_id: bytes, keys: list[bytes], time_remaining_s: float | None) -> list[LocationRun]:
        if not (self.tenancy.may_read(who, namespace_id) or self._unbound_for(who, namespace_id)):
            return []
        runs = self.cluster.lookup(namespace_id, keys, time_remaining_s, on_behalf(who))
        # Unbound when asked, or bound by the caller's own first write, which may fail and be undone: another
        # tenant's first write here may have bound it and stored a page since, which the lookup (this node's
        # directory first) answered; a binding comes before any page of its write
        return runs if self.tenancy.sees(who, namespace_id) or self.tenancy.owners.owner(namespace_id) is None else []

    def fill(self, who: Identity, namespace_id: bytes, keys: list[bytes], time_remaining_s: float | None,
             landing: Landing | None = None) -> bool:
        """Fetches what other nodes hold of ``keys`` for ``who`` (into ``landing``: by default
        ``landing_for``'s); returns whether ``who`` may read the namespace here now (the caller
        acquires only then)."""
        tenant, owners = on_behalf(who), self.tenancy.owners
        readable = self.tenancy.may_read(who, namespace_id)
        if not readable and not self._unbound_for(who, namespace_id):
            return False
        # Unbound: claimed for the caller before the fetch. Bound to the caller: maybe only by its own first write
        # here, still running, which may fail and be undone; the fill holds the binding as a write does (a claim,
        # False once settled), so that a page it lands keeps it. An admin's read of another's namespace claims nothing.
        bound = owners.owner(namespace_id)
        claimed = False
        if who.via != "local" and (bound == who.tenant if readable else bound is None):
            try:
                claimed = owners.claim(namespace_id, who.tenant)
            except PermissionDenied:  # bound to another tenant meanwhile
                return False
        remote = self.cluster.remote
        before = remote.local_prefix(namespace_id, keys) if claimed else 0
        try:
            self.cluster.fill(namespace_id, keys, time_remaining_s, tenant, landing or self.landing_for(who, namespace_id, keys))
        finally:
            if claimed:  # bound if the fill stored pages, raised or not (as Tenancy.copying)
                owners.settle(namespace_id, who.tenant, remote.local_prefix(namespace_id, keys) > before)
        return self.tenancy.may_read(who, namespace_id)

    def prefetch(self, who: Identity, namespace_id: bytes, keys: list[bytes]) -> None:
        """A hint's fetch ahead: only into a namespace bound here to the caller (one nobody holds
        here is fetched when it is read), by a write that succeeded: the fetch runs after the hint
        answers, and a first write still running may fail and undo the binding meanwhile."""
        if self.tenancy.may_read(who, namespace_id) and (who.via == "local" or self.tenancy.owners.settled(namespace_id)):
            self.cluster.prefetch(namespace_id, keys, on_behalf(who), self.landing_for(who, namespace_id, keys))

    def landing_for(self, who: Identity, namespace_id: bytes, keys: list[bytes]) -> Landing | None:
        """The fetch lands within ``who``'s host quota here (fetch_room.py)."""
        return quota_landing(self.tenancy.quotas, self.cluster.core, who, namespace_id, keys)
