"""Where a remote fetch's pages land, and who they are charged to (DESIGN §11): the protocol
``RemoteTier`` fetches into, and the node's own landing that charges nobody (a tenant's is
tenancy/fetch_room.py)."""

from __future__ import annotations

from typing import Protocol

from kvstore.errors import KVStoreError
from kvstore.page import LayoutDesc
from kvstore.server.placement import Placement


class Landing(Protocol):
    """Where a fetch's pages land, and who they are charged to (DESIGN §11). Called on worker
    threads. ``allocate`` answers as ``Placement.allocate`` (a prefix of ``keys``; a KVStoreError:
    nothing allocated, the fetch ends there), ``commit`` as ``Placement.commit``. A tenant's
    (tenancy/fetch_room.py) takes room in its host quota first; the node's own (``NodeLanding``)
    charges nobody."""

    def allocate(self, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes],
                 generation: int) -> tuple[bytes, list[tuple[bytes, int | None]]]: ...

    def commit(self, allocation_id: bytes, keys: list[bytes], checksums: list[int]) -> int: ...

    def cut(self) -> None:
        """The fetch was cut at its caller's deadline (from the loop, any time): an ``allocate``
        still making room stops at its next step (the fetch waits for it to end)."""


class NodeLanding:
    """The landing of a fetch for nobody's quota: a node without tenants, a copy whose caller
    reserved the room itself (a handoff's push)."""

    def __init__(self, core: Placement) -> None:
        self.core = core

    def allocate(self, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes],
                 generation: int) -> tuple[bytes, list[tuple[bytes, int | None]]]:
        return self.core.allocate(namespace_id, layout, keys, generation=generation)

    def commit(self, allocation_id: bytes, keys: list[bytes], checksums: list[int]) -> int:
        return self.core.commit(allocation_id, keys, checksums)

    def cut(self) -> None:
        pass  # its allocate makes no room: it ends soon whatever happens


class NotedLanding:
    """A landing that notes whether it held its fetch short (refused, or allocated fewer pages
    than asked): a fetch it cut short says nothing of the holder's records (RemoteTier's retry),
    and a handoff's pull it cut short landed what the tenant's room holds (HandoffGate.wait)."""

    def __init__(self, inner: Landing) -> None:
        self.inner = inner
        self.short = False

    def allocate(self, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes],
                 generation: int) -> tuple[bytes, list[tuple[bytes, int | None]]]:
        try:
            allocation_id, slots = self.inner.allocate(namespace_id, layout, keys, generation)
        except KVStoreError:
            self.short = True
            raise
        self.short = self.short or len(slots) < len(keys)
        return allocation_id, slots

    def commit(self, allocation_id: bytes, keys: list[bytes], checksums: list[int]) -> int:
        return self.inner.commit(allocation_id, keys, checksums)

    def cut(self) -> None:
        self.inner.cut()
