"""The Stats answer of a caller without the admin right: only its own namespaces.

A tenant sees how many pages and bytes of its own it has in each of this node's tiers
(and the tiers' capacities, which are the operator's public figures), its own
quarantined pages and the event sequence it subscribes from; not the server-wide hit,
eviction and SSD-budget counters, which would tell it how busy the other tenants are.
Not a hot path: it walks the directory entries of the tenant's namespaces.
"""

from __future__ import annotations

from kvstore._proto import directory_pb2
from kvstore.security.identity import Identity
from kvstore.server.placement import Placement
from kvstore.server.tenancy import Tenancy
from kvstore.server.tenancy.owners import owner_for


def tenant_stats(core: Placement, tenancy: Tenancy, who: Identity) -> directory_pb2.StatsResponse:
    directory = core.directory
    pages: dict[str, int] = {}
    used: dict[str, int] = {}
    num_entries = 0
    for namespace_id in tenancy.owners.namespaces_of(who.tenant):
        for key in directory.keys_of(namespace_id):
            entry = directory.get(key)
            if entry is None:
                continue
            num_entries += 1
            for loc in list(entry.locations.values()):
                if loc.node == core.node:
                    pages[loc.tier] = pages.get(loc.tier, 0) + 1
                    used[loc.tier] = used.get(loc.tier, 0) + loc.size_bytes
    tiers = [directory_pb2.TierStats(tier=name, num_pages=pages.get(name, 0), used_bytes=used.get(name, 0),
                                     capacity_bytes=usage.capacity_bytes)
             for name, usage in core.reporter.usages().items()]
    quarantined = sum(1 for q in core.quarantined() if tenancy.sees(who, q.namespace_id))
    return directory_pb2.StatsResponse(node=core.node, num_entries=num_entries, last_seq=directory.events.last_seq,
                                       tiers=tiers, num_leases=core.leases.held(owner_for(who.tenant))[0], num_quarantined=quarantined,
                                       tenants=[tenant_usage(tenancy, who.tenant)])


def tenant_usage(tenancy: Tenancy, tenant: str) -> directory_pb2.TenantUsage:
    return directory_pb2.TenantUsage(tenant=tenant, used=tenancy.quotas.usage(tenant),
                                     limits=vars(tenancy.quotas.limits(tenant)))
