"""The tenancy gate's handoff operations (prefill -> decode, DESIGN §12.7: Complete, Wait, Push):
a mixin of ``Gate`` (gate.py), apart because they drive the decode node's completion markers."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from kvstore.errors import InvalidRequest, LimitExceeded, PermissionDenied, TierUnavailable
from kvstore.page import LayoutDesc
from kvstore.page_wire.fetch_frames import NO_ALLOCATION
from kvstore.security.identity import Identity, Rights
from kvstore.server.handoff_markers import MAX_TTL_S, HandoffMarkers
from kvstore.server.placement import Placement
from kvstore.server.tenancy.access import Tenancy
from kvstore.server.tenancy.cluster_reads import ClusterReads
from kvstore.server.tenancy.fetch_room import quota_landing
from kvstore.server.tenancy.node_calls import acting_for, on_behalf
from kvstore.server.tenancy.quotas import NOTHING, Reservation
from kvstore.server.tenancy.room import CallContext, room

if TYPE_CHECKING:  # cluster mode is imported only when the server runs it
    from kvstore.cluster.page_fetch import FetchResult
    from kvstore.server.cluster import ClusterRuntime
    from kvstore.server.cluster.landing import Landing

logger = logging.getLogger(__name__)

DEFAULT_TTL_MS = 30_000
MARGIN_S = 0.25  # of a caller's deadline, kept for the answer to reach it


class WaitContext(CallContext, Protocol):
    def add_callback(self, callback: Callable[[], None]) -> bool: ...


def require_writer(who: Identity) -> None:
    if not who.allows(Rights.WRITE):
        raise PermissionDenied(f"tenant {who.tenant!r} lacks the write right (a handoff hands off pages it stored)")


class HandoffGate:
    """Needs ``core``, ``tenancy``, ``handoffs``, ``cluster`` and ``cluster_reads`` of the gate it is mixed into."""

    core: Placement
    tenancy: Tenancy
    handoffs: HandoffMarkers | None
    cluster: ClusterRuntime | None
    cluster_reads: ClusterReads | None

    @property
    def _markers(self) -> HandoffMarkers:
        assert self.handoffs is not None, "the server builds the gate with its handoff markers"
        return self.handoffs

    def open_handoff(self, who: Identity, ns: bytes, ident: bytes, to_node: str, ttl_ms: int, keys: list[bytes]) -> None:
        """At the prefill node: announced to ``to_node`` when pages go to another node (else the
        pool carries them, or this node is the decode node: nothing to announce)."""
        require_writer(who)
        if self.cluster is not None and bool(to_node) and to_node != self.core.node:
            self.cluster.call(self.cluster.handoffs.open(on_behalf(who), ns, ident, to_node, ttl_ms, keys,
                                                         lambda: self.tenancy.sees(who, ns)), self.cluster.cluster.rpc_timeout_s)

    def complete(self, who: Identity, ns: bytes, ident: bytes, keys: list[bytes], to_node: str, context: CallContext) -> int:
        """The pages of ``keys`` handed to ``to_node`` (another node: through its Push; else the
        marker is here, completed with what this node holds; no keys: the marker here is dropped)."""
        require_writer(who)
        readable = self.tenancy.may_read(who, ns)
        if self.cluster is not None and to_node != self.core.node:
            left = context.time_remaining()
            timeout = max(0.01, (left if left is not None else 30.0) - MARGIN_S)
            try:
                return self.cluster.call(self.cluster.handoffs.complete(on_behalf(who), ns, ident, keys if readable else [],
                                                                        to_node, timeout), timeout + 1)
            except TimeoutError:
                raise TierUnavailable(f"handoff not completed within {timeout:.1f} s; the pages stay here") from None
        if not keys:  # nothing handed off (or a decode that will not take it): the marker here goes with its pins
            self._markers.abandon(who.tenant, ns, ident, DEFAULT_TTL_MS)
            return 0
        held = self._markers.held(ns, keys) if readable else 0
        if held:
            marker = self._markers.open(who.tenant, ns, ident, DEFAULT_TTL_MS)
            self._markers.arrived(marker, keys[:held], pushed=True, complete=keys[:held])
        return held

    def wait(self, who: Identity, ns: bytes, ident: bytes, keys: list[bytes], deadline_ms: int, context: WaitContext,
             slot: Callable[[], AbstractContextManager[None]]) -> tuple[int, int]:
        """Pages of the handoff here by its deadline, and the marker's generation; ``slot`` is
        taken (the servicer's stream slot) once the read right is checked."""
        self.tenancy.may_read(who, ns)  # PermissionDenied without the read right
        left = context.time_remaining()
        deadline = min(deadline_ms / 1000, (left if left is not None else MAX_TTL_S) - MARGIN_S)
        markers = self._markers
        with slot():
            reads = self.cluster_reads
            # the wait's deadline kept the answer's margin already: ClusterRuntime.fill keeps its own

            def pull(time_left: float) -> bool:
                """A pull through the pool (cluster mode); True when the tenant's room here held it short."""
                from kvstore.server.cluster.landing import NotedLanding  # cluster mode only

                assert reads is not None
                quota = reads.landing_for(who, ns, keys)
                noted = NotedLanding(quota) if quota is not None else None  # the node's own (no tenants): no room to note
                reads.fill(who, ns, keys, time_left + MARGIN_S, noted)
                return noted is not None and noted.short

            context.add_callback(markers.wake)  # a cancelled wait ends now, its stream slot given back
            # opened as its reader (nothing drops it before the wait reads it); the wait, called next, counts it off
            marker = markers.open(who.tenant, ns, ident, max(DEFAULT_TTL_MS, deadline_ms), waiter=True)
            n = markers.wait(marker, keys, max(0.0, deadline), pull if reads is not None else None, sees=lambda: self.tenancy.may_read(who, ns),
                             alive=context.is_active, registered=True)
        return n, marker.generation

    def push(self, who: Identity, ns: bytes, ident: bytes, keys: list[bytes], holder: str, ttl_ms: int, tenant: str,
             page_bytes: int, complete: bool, context: CallContext) -> int:
        """A node's Push (its node right checked first, by the servicer): see HandoffService.Push."""
        if self.cluster is None or not holder or (keys and page_bytes <= 0 and not complete):
            raise InvalidRequest("Handoff.Push needs cluster mode, a holder and page_bytes")
        who = acting_for(who, tenant)
        if complete and not keys:  # nothing handed off: the pushed pages are let go now, not at the ttl
            self._markers.abandon(who.tenant, ns, ident, ttl_ms)
            return 0
        # bound if the push stored pages (its layers or its copy), raised or not (Tenancy.copying)
        with self.tenancy.copying(who, ns, lambda: self._markers.held(ns, keys)):
            marker = self._markers.open(who.tenant, ns, ident, ttl_ms)
            if not keys:
                self._markers.arrived(marker, [], pushed=True)
                return 0
            if page_bytes <= 0:  # a complete whose holder has none of them now: the handoff is what was pushed here
                held = self._markers.held(ns, keys)
                self._markers.arrived(marker, keys, pushed=True, complete=keys[:held])
                return held
            if marker.layers is not None:  # pages whose layers came ahead: their rest fetched, committed in place
                marker.layers.commit(keys, lambda ks, views, offset: self._rest(holder, ns, ks, views, offset, marker.generation,
                                                                               context))
            have = self._markers.held(ns, keys)
            fits, reserved = self._handoff_room(who, len(keys) - have, page_bytes, context)
            try:
                want = keys[: have + fits]
                # unhashed: the prefill node keeps its copy, the decode side's copy out of the arena checks it (DESIGN §4)
                held = self.cluster.copy_from(holder, ns, want, page_bytes, context.time_remaining(), on_behalf(who), hashed=False)
                if complete and held < len(want):  # what the holder could not give: through the pool
                    self.cluster.fill(ns, want, context.time_remaining(), on_behalf(who))
                    held = self._markers.held(ns, want)
            finally:
                reserved.release()  # the pages that landed count as the tenant's host bytes now
            # complete: the handoff is what is held here now (the rest over the tenant's quota, or not to be had),
            # as the prefill node's Complete answers it: a wait for the whole prompt answers at once, not at its deadline
            self._markers.arrived(marker, keys, pushed=True, complete=keys[:held] if complete else None)
        return held

    def push_layers(self, who: Identity, ns: bytes, ident: bytes, holder: str, tenant: str, layout: LayoutDesc,
                    keys: list[bytes], offset: int, length: int, allocation: bytes, ttl_ms: int, context: CallContext) -> int:
        """A node's PushLayers (its node right checked first): fetches a range of each page from the
        holder's ``allocation`` into the handoff's slots here, within the tenant's host quota
        (layer_landings.py); how many landed."""
        if self.cluster is None or not holder:
            raise InvalidRequest("Handoff.PushLayers needs cluster mode and a holder")
        who = acting_for(who, tenant)
        claimed = self.tenancy.claim(who, ns)
        landed = 0
        try:
            marker = self._markers.open(who.tenant, ns, ident, ttl_ms)
            self._markers.arrived(marker, [], pushed=True)  # as the announce: a wait sleeps until the pages come
            from kvstore.cluster.page_fetch import FetchStatus  # cluster mode only

            def pull(wanted: list[bytes], views: list[memoryview]) -> list[bool]:
                result = self._fetch(holder, ns, wanted, views, offset, layout.page_bytes, marker.generation, context, allocation)
                return [s is FetchStatus.OK for s in result.statuses] if result is not None else []

            landed = self._markers.layers(marker).land(ns, layout, keys, offset, length, marker.generation,
                                                       lambda new: self._landing(who, ns, new), pull)
        finally:
            if claimed:
                self.tenancy.settle(who, ns, landed > 0)
        return landed

    def _rest(self, holder: str, ns: bytes, keys: list[bytes], views: list[memoryview], offset: int, generation: int,
              context: CallContext) -> list[int]:
        """The rest of pages whose layers landed ahead, from ``holder``'s stored pages: the stored
        checksums of the leading ones that arrived."""
        result = self._fetch(holder, ns, keys, views, offset, 0, generation, context)
        return result.checksums[: result.prefix] if result is not None else []

    def _fetch(self, holder: str, ns: bytes, keys: list[bytes], views: list[memoryview], offset: int, page_bytes: int,
               generation: int, context: CallContext, allocation: bytes = NO_ALLOCATION) -> FetchResult | None:
        """layer_pushes.fetch_range on the cluster loop, within the caller's deadline; None when it failed;
        DestinationsInUse when the transport may still write into ``views`` (raised so, or the cause of
        the call's TimeoutError when it was cut: UCX's abort waiting on its posted receives)."""
        from kvstore.cluster.cluster_errors import DestinationsInUse  # cluster mode only
        from kvstore.server.cluster.layer_pushes import fetch_range
        from kvstore.server.cluster.remote import destinations_in_use

        assert self.cluster is not None
        left = context.time_remaining()
        timeout = max(0.01, (left if left is not None else 30.0) - MARGIN_S)
        try:
            # to the end: a fetch cut at its deadline returns once it stopped writing into the views (slots given back next)
            return self.cluster.call(fetch_range(self.cluster.peers, holder, ns, keys, views, offset, page_bytes, timeout,
                                                 generation, allocation), timeout + 1, to_end=True)
        except Exception as exc:  # any failure (a timeout, the node leaving): those pages come whole
            if isinstance(exc, DestinationsInUse):
                raise  # the views may still be written into: LayerLanding keeps their slots back
            if destinations_in_use(exc):  # cut: its TimeoutError's cause, raised as what LayerLanding looks for
                raise DestinationsInUse(f"a range fetch cut at its deadline: {exc.__cause__}") from exc
            logger.info("a range of %d handed-off pages not fetched from %s: %r", len(keys), holder, exc)
            return None

    def _landing(self, who: Identity, ns: bytes, keys: list[bytes]) -> Landing:
        """Where a handoff's layers land: within the tenant's host quota here (none: the node's own)."""
        from kvstore.server.cluster.landing import NodeLanding  # cluster mode only

        return quota_landing(self.tenancy.quotas, self.core, who, ns, keys) or NodeLanding(self.core)

    def _handoff_room(self, who: Identity, lacking: int, page_bytes: int, context: CallContext) -> tuple[int, Reservation]:
        """How many of the ``lacking`` pages fit in the tenant's host quota here (its own coldest
        pages written down to make room, as for a put), reserved while they land; halved until
        they fit, else none. A handoff's bytes count as any page of the tenant's."""
        while lacking > 0:
            try:
                return lacking, room(self.tenancy.quotas, self.core, who, lacking, page_bytes, context)
            except LimitExceeded:
                lacking //= 2
        return 0, NOTHING
