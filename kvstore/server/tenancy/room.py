"""Room for an allocation at its tenant's host quota: the tenant's own coldest pages go.

Apart from the gate (gate.py) because the loop is its own policy: when a pass helps, when
asking again is pointless, and what a refusal looks like to the caller."""

from __future__ import annotations

from typing import Protocol

from kvstore.errors import HostQuotaFull
from kvstore.security.identity import Identity
from kvstore.server.placement import Placement
from kvstore.server.tenancy.quotas import Quotas, Reservation

# Eviction passes a call at its host quota may make, each of which made the room it asked for,
# before it is refused: the tenant's other calls take that room meanwhile (8 soak clients of one
# tenant at their quota took it 5 times running once in 11,667 puts with 4), and a commit landing
# between the reads of slot and page bytes counts its bytes twice for that one check.
ROOM_TRIES = 16


class CallContext(Protocol):
    """What the tenancy reads of a call's context (a gRPC ServicerContext, a call socket's): whether its caller still waits."""

    def is_active(self) -> bool: ...

    def time_remaining(self) -> float | None: ...


def room(quotas: Quotas, core: Placement, who: Identity, num_pages: int, page_bytes: int,
         context: CallContext | None = None, parent: bytes | None = None) -> Reservation:
    """Reserves the tenant's quotas for an allocation of ``num_pages`` new pages; at its host
    quota, its own coldest pages make room (written down), never another tenant's. Asked again
    after each pass, up to ROOM_TRIES times: the tenant's other calls may take the room made
    meanwhile, which is no reason to refuse. A pass that could not evict down to what it
    needed (what is left of its own is pinned or reserved) or a caller gone (its deadline
    passed; a fetch cut: fetch_room.QuotaLanding is its own context) ends the passes: it is asked once more, then refused with a QuotaExceeded that says what the passes
    freed (HostQuotaFull is the servicer's own signal to make room, never sent). ``parent``: the
    page the allocation names as its parent; the passes take its chain last (DESIGN §6)."""
    before: int | None = None  # the tenant's host bytes when the first pass began
    for _ in range(ROOM_TRIES):
        try:
            return quotas.pages(who, num_pages, page_bytes)
        except HostQuotaFull as full:
            if context is not None and _gone(context):
                break
            if before is None:
                before = _host_bytes(quotas, who)
            if not core.evict_own(quotas.owners.namespaces_of(who.tenant), full.keep_bytes, parent):
                break  # another pass would walk the same pins
    try:
        return quotas.pages(who, num_pages, page_bytes)
    except HostQuotaFull as full:
        quotas.refused(who.tenant, "host_bytes")
        freed = 0 if before is None else before - _host_bytes(quotas, who)  # the passes may have written some down
        raise full.after_freeing(freed) from None


def _host_bytes(quotas: Quotas, who: Identity) -> int:
    return quotas.usage(who.tenant, ["host_bytes"])["host_bytes"]


def _gone(context: CallContext) -> bool:
    """Whether the caller will not hear the answer: a gRPC call ended, or a call socket's
    deadline passed (its context stays active until the answer is written: kvstore/callsocket/context.py)."""
    left = context.time_remaining()
    return not context.is_active() or (left is not None and left <= 0)
