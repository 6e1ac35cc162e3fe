"""The tenancy gate's shared memory (GetInfo, and the arena and pool Allocate and Acquire answer
in): a mixin of ``Gate`` (gate.py), apart because it decides which memory a caller maps, not
what it may store.

Each arena and each hbm pool is one trust domain (DESIGN §11): whoever maps it reads and writes
all of it. Without tenants (or with --share-arena) the one arena is announced by path and the
one pool by the arena socket; with tenants the caller's own arena and pool, each made at its
first use, are handed over by the arena socket to the caller's token and to no other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import InvalidRequest
from kvstore.security.arena_socket import may_map_pool
from kvstore.security.identity import Identity
from kvstore.server.placement import Placement
from kvstore.server.placement.reads import AcquiredPage
from kvstore.server.tenancy.access import Tenancy
from kvstore.server.tenancy.owners import owner_for
from kvstore.tiers.base import ArenaInfo


@dataclass(frozen=True)
class MemoryInfo:
    """GetInfo's shared-memory fields for one caller: its arena by path or by the arena socket
    (neither: it maps none, its pages go over gRPC), and the socket handing out its hbm pool."""

    arena_path: str = ""
    arena_socket: str = ""
    arena_bytes: int = 0
    arena_token: bytes = b""
    pool_socket: str = ""


@dataclass(frozen=True)
class MappedPage:
    """An acquired page's place: its offset in the caller's arena and, copied to the caller's
    pool, its offset there (None: not on the device)."""

    key: bytes
    offset: int
    checksum: int
    device_offset: int | None


@dataclass(frozen=True)
class Mapped:
    """Acquire's answer in plain values: the lease, the pages' size, the tokens the caller's
    arena and pool start with (empty: none), each page's place, and the namespace generation
    read before the pages were leased (an engine's saves name it: DESIGN §3)."""

    lease_id: bytes
    page_bytes: int
    arena_token: bytes
    pool_token: bytes
    pages: list[MappedPage]
    generation: int = 0


class ArenaGate:
    """Needs ``core``, ``tenancy``, ``share_arena``, ``arena_socket`` (set with tenant arenas:
    where a caller fetches its own arena) and ``pool_socket`` (set with hbm: where an engine
    fetches its tenant's pool) of the gate it is mixed into."""

    core: Placement
    tenancy: Tenancy
    share_arena: bool
    arena_socket: Path | None
    pool_socket: Path | None

    def memory_info(self, who: Identity) -> MemoryInfo:
        """GetInfo's arena and pool fields for ``who``: only its own tenant's are named."""
        arena = self._arena(who)
        pool_socket = str(self.pool_socket) if self.pool_socket is not None and may_map_pool(who) else ""
        if arena is not None and (arena.path or self.arena_socket is None):
            return MemoryInfo(arena.path, "", arena.size_bytes, arena.token, pool_socket)
        if arena is not None:
            return MemoryInfo("", str(self.arena_socket), arena.size_bytes, arena.token, pool_socket)
        return MemoryInfo(pool_socket=pool_socket)

    def _arena(self, who: Identity) -> ArenaInfo | None:
        """The caller's arena (None: none); Allocate and Acquire name its token (client/restart.py)."""
        if who.via == "local" or self.share_arena:
            return self.core.arena_of()
        return self.core.arena_of(owner_for(who.tenant)) if self.arena_socket is not None else None

    def _arena_token(self, who: Identity) -> bytes:
        arena = self._arena(who)
        return arena.token if arena is not None else b""

    def _check_arena(self, who: Identity, namespace_id: bytes) -> None:
        """With an arena per tenant, Acquire answers slots in the arena of the namespace's
        owner: a reader of another tenant's namespace (admin) is told to use ReadPages (a
        caller that may not read it learns nothing here: it is answered as empty)."""
        owner = self.tenancy.owners.owner(namespace_id)
        if self.arena_socket is not None and owner not in (None, who.tenant) and self.tenancy.may_read(who, namespace_id):
            raise InvalidRequest("the namespace's pages are in its owner's arena, which this caller does not map; "
                                 "read them with ReadPages")

    def _to_device(self, who: Identity, device: bool) -> bool:
        """Whether Acquire copies the pages into the caller's pool: asked for, and the caller
        may map that pool (else no engine of it could read the copies)."""
        return device and self.pool_socket is not None and may_map_pool(who)

    def _mapped(self, who: Identity, ident: bytes, pages: list[AcquiredPage], device: bool) -> Mapped:
        """Each page's offset in the caller's arena and, with ``device``, in its pool (only that
        of the caller's own tenant: the one its token was handed)."""
        arena_token = self._arena_token(who)
        token, offsets = self.core.promoter.placed(pages) if device else (b"", [None] * len(pages))
        pool = self.core.pool_of(owner_for(who.tenant)) if token else None
        if pool is None or pool.token != token:
            token, offsets = b"", [None] * len(pages)
        return Mapped(ident, pages[0].header.payload_bytes if pages else 0, arena_token, token,
                      [MappedPage(p.key, self.core.landing.at(p.slot).offset(p.slot), p.checksum, o)
                       for p, o in zip(pages, offsets)])
