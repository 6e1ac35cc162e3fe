"""Pages fetched from other nodes for a tenant land within its host quota here (DESIGN §11), as
its puts do: a fill (get, ReadPages, a handoff wait's pull), a hint's prefetch and a replica.

More: kvstore/server/tenancy/README.md (### fetch_room.py).
"""

from __future__ import annotations

import threading

from kvstore.errors import LimitExceeded
from kvstore.page import LayoutDesc
from kvstore.security.identity import Identity
from kvstore.server.placement import Placement
from kvstore.server.tenancy.owners import owner_for
from kvstore.server.tenancy.quotas import NOTHING, Quotas, Reservation
from kvstore.server.tenancy.room import room


class QuotaLanding:
    """The landing of one fetch for ``who`` of the chain ``keys`` of ``namespace_id``; used from
    the cluster loop's worker threads, one call at a time."""

    def __init__(self, quotas: Quotas, core: Placement, who: Identity, namespace_id: bytes, keys: list[bytes]) -> None:
        self.quotas = quotas
        self.core = core
        self.who = who
        self.namespace_id = namespace_id
        self.chain = keys
        self.page_bytes = 0
        self._cut = threading.Event()  # the fetch's caller is gone: make no more room

    def cut(self) -> None:
        self._cut.set()

    # its allocate's call context (room.CallContext): its caller waits until the fetch is cut
    def is_active(self) -> bool:
        return not self._cut.is_set()

    def time_remaining(self) -> float | None:
        return None  # the fetch's deadline is the cluster loop's (cut() when it passes)

    def allocate(self, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes],
                 generation: int) -> tuple[bytes, list[tuple[bytes, int | None]]]:
        lacking = [i for i, key in enumerate(keys) if not self.core.residence.stored(key)]
        fits, held = 0, NOTHING
        if lacking:
            lease, _, _ = self.core.lease(self.namespace_id, self.chain, 0)  # its held prefix is not room for it
            try:
                fits, held = self._room(len(lacking), layout.page_bytes)
            finally:
                self.core.release(lease)
        if lacking and not fits:
            raise LimitExceeded(f"tenant {self.who.tenant!r} has no room in its host quota at node {self.core.node} for "
                                "pages fetched from another node; nothing was fetched")
        end = lacking[fits] if fits < len(lacking) else len(keys)
        self.page_bytes = layout.page_bytes
        try:
            return self.core.allocate(namespace_id, layout, keys[:end], owner_for(self.who.tenant), None,
                                      self.quotas.handing_over(held), generation)
        finally:
            held.release()  # handed over to the allocation's slots (or it failed)

    def commit(self, allocation_id: bytes, keys: list[bytes], checksums: list[int]) -> int:
        bridge = self.quotas.hold(self.who, host_bytes=len(keys) * self.page_bytes)  # slots to pages, counted throughout
        try:
            return self.core.commit(allocation_id, keys, checksums, counting=self.quotas.handing_over(bridge))
        finally:
            bridge.release()

    def _room(self, lacking: int, page_bytes: int) -> tuple[int, Reservation]:
        while lacking > 0 and not self._cut.is_set():
            try:
                return lacking, room(self.quotas, self.core, self.who, lacking, page_bytes, self)
            except LimitExceeded:
                lacking //= 2
        return 0, NOTHING


def quota_landing(quotas: Quotas, core: Placement, who: Identity, namespace_id: bytes, keys: list[bytes]) -> QuotaLanding | None:
    """The landing of a fetch for ``who``: None (the node's own, uncharged) for the local tenant of
    a server without tenants, which has no quota."""
    return None if who.via == "local" else QuotaLanding(quotas, core, who, namespace_id, keys)
