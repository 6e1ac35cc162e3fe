"""The tiers a configuration asks for, opened in order and wrapped, each with the core's
eviction orders it tells what it stores (orders.py): the one place that names concrete tier
and order classes (the core only knows the protocols)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvstore.config import ServerConfig
from kvstore.directory import Directory
from kvstore.server.admission import AdmissionPolicy, AdmittedTier, WriteBudget, make_policy
from kvstore.server.metrics import Metrics
from kvstore.server.placement.orders import HostOrder, LandingOrders, LruOrder, Orders, TailFirstOrder
from kvstore.tiers.arenas import TenantArenas
from kvstore.tiers.base import UNOWNED, LandingTier, Tier
from kvstore.tiers.host import HostTier
from kvstore.tiers.pinned import ArenaPins, pinned
from kvstore.tiers.ssd import SsdTier

Wrap = Callable[[Tier], Tier]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Recovery creates an object or two per stored page; the cyclic GC would rescan the
    growing heap again and again meanwhile (none of these objects form cycles)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def open_directory(config: ServerConfig) -> Directory:
    """This node's directory, its durable records loaded from ``config.data_dir``."""
    with gc_paused():
        return Directory(config.data_dir, config.node, config.directory_map_bytes)


def open_upper(config: ServerConfig, wrap: Wrap | None = None) -> tuple[list[Tier], list[Orders[LruOrder]]]:
    """The tiers above the landing tier (hbm: one device pool per tenant, or one without
    tenant arenas, tiers/pools.py), fastest first, and their orders. torch is imported only
    when they are asked for (the server does not need it otherwise)."""
    if "hbm" not in config.tiers:
        return [], []
    from kvstore.tiers.pools import TenantPools

    per_tenant = bool(config.security.tenants) and not config.security.share_arena
    orders = Orders(LruOrder, shared=not per_tenant)
    return [(wrap or (lambda tier: tier))(TenantPools(config.hbm, per_tenant, events=orders.make))], [orders]


def open_tiers(config: ServerConfig, metrics: Metrics, clock: Callable[[], float], wrap: Wrap | None = None,
               policy: AdmissionPolicy | None = None, arena_bytes: Callable[[str], int] | None = None,
               ) -> tuple[LandingTier, list[AdmittedTier], list[Tier], list[Orders]]:
    """The landing tier (host), the demotion targets (ssd, with its admission policy and
    write budget) and the tiers above the landing tier (hbm, see ``open_upper``). ``wrap``
    goes around each tier first (tests: ``FaultyTier``); ``policy`` replaces the configured
    admission policy (the replay's oracle). With tenants (and not --share-arena) the host
    tier is one arena per tenant, of ``arena_bytes(tenant)`` bytes, made lazily. With hbm every
    arena is page-locked for the pools' copies, each tenant's as it is made (tiers/pinned.py).
    The orders come last, one ``Orders`` per tier in the core's order: landing, lower, upper."""
    wrap = wrap or (lambda tier: tier)
    upper, upper_orders = open_upper(config, wrap)  # first: a device that cannot be used refuses before an arena is made
    pins = ArenaPins(upper[0].ops) if upper else None  # type: ignore[attr-defined]  # TenantPools.ops
    per_tenant = bool(config.security.tenants) and not config.security.share_arena
    landing_orders = LandingOrders(HostOrder, shared=not per_tenant)
    try:
        if per_tenant:
            landing = wrap(TenantArenas(config.host, config.node, arena_bytes or (lambda tenant: 0), pins, landing_orders.make))
        else:
            landing = wrap(pinned(HostTier(config.host, config.node, events=landing_orders.make(UNOWNED, config.host)), pins))
    except BaseException:  # no arena: the pools made already go back to the device
        for tier in upper:
            tier.close()
        raise
    if not isinstance(landing, LandingTier):
        raise TypeError(f"{landing!r} cannot be the landing tier")
    lower: list[AdmittedTier] = []
    lower_orders: list[Orders] = []
    try:
        if "ssd" in config.tiers and config.ssd is not None:
            lower_orders.append(Orders(TailFirstOrder))
            ssd = SsdTier(config.ssd, events=lower_orders[-1].make())
            budget = WriteBudget.for_drive(config.ssd.capacity_bytes, config.ssd.dwpd, clock, config.ssd.burst_s,
                                           settle=ssd.index_writes.take)
            lower.append(AdmittedTier(wrap(ssd), policy or make_policy(config.ssd.admission), budget, metrics,
                                      SsdTier.slot_bytes, config.ssd.capacity_bytes, config.ssd.dwpd))
    except BaseException:
        for tier in (landing, *upper):
            tier.close()
        raise
    return landing, lower, upper, [landing_orders, *lower_orders, *upper_orders]
