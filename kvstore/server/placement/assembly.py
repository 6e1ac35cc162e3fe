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
from kvstore.tiers.arenas import OwnerArenas
from kvstore.tiers.base import LandingPart, Tier
from kvstore.tiers.owner_parts import OwnerParts, OwnerWords
from kvstore.tiers.pinned import ArenaPins
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


def open_upper(config: ServerConfig, wrap: Wrap | None = None,
               words: OwnerWords | None = None) -> tuple[list[OwnerParts[Tier]], list[Orders[LruOrder]]]:
    """The tiers above the landing tier (hbm: one device pool per owner, or one for all,
    tiers/pools.py; ``wrap`` goes around each pool), fastest first, and their orders. torch is
    imported only when they are asked for (the server does not need it otherwise)."""
    if "hbm" not in config.tiers:
        return [], []
    from kvstore.tiers.pools import OwnerPools

    per_owner = config.security.parts_per_owner
    orders = Orders(LruOrder, shared=not per_owner)
    return [OwnerPools(config.hbm, per_owner, events=orders.make, wrap=wrap, words=words)], [orders]  # type: ignore[arg-type]


def open_tiers(config: ServerConfig, metrics: Metrics, clock: Callable[[], float], wrap: Wrap | None = None,
               policy: AdmissionPolicy | None = None, arena_bytes: Callable[[str], int] | None = None,
               words: OwnerWords | None = None) -> tuple[OwnerParts[LandingPart], list[AdmittedTier], list[OwnerParts[Tier]], list[Orders]]:
    """The landing tier (host), the demotion targets (ssd, with its admission policy and
    write budget) and the tiers above the landing tier (hbm, see ``open_upper``). ``wrap``
    goes around each tier (each arena or pool of a map of them) first (tests: ``FaultyTier``);
    ``policy`` replaces the configured admission policy (the replay's oracle). The host tier is a
    map of arenas (tiers/arenas.py): with ``parts_per_owner`` one per owner, of ``arena_bytes(owner)``
    bytes, made lazily; else one, made now (``words``: how their refusals name an owner). With hbm
    every arena is page-locked for the pools' copies, each as it is made (tiers/pinned.py).
    The orders come last, one ``Orders`` per tier in the core's order: landing, lower, upper."""
    wrap = wrap or (lambda tier: tier)
    upper, upper_orders = open_upper(config, wrap, words)  # first: a device that cannot be used refuses before an arena is made
    pins = ArenaPins(upper[0].ops) if upper else None  # type: ignore[attr-defined]  # OwnerPools.ops
    per_owner = config.security.parts_per_owner
    landing_orders = LandingOrders(HostOrder, shared=not per_owner)
    try:
        landing: OwnerParts[LandingPart] = OwnerArenas(  # type: ignore[assignment]  # its arenas are LandingParts
            config.host, config.node, arena_bytes or (lambda owner: 0), pins, landing_orders.make, per_owner, wrap,  # type: ignore[arg-type]
            words)
    except BaseException:  # no arena: the pools made already go back to the device
        for tier in upper:
            tier.close()
        raise
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
