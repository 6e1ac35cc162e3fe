"""What the Data servicer tells a same-host caller about the memory it maps: its arena and,
with hbm, its device pool (GetInfo), and where an Acquire's pages are in them.

Each is one trust domain (DESIGN §11): whoever maps it reads and writes all of it. Without
tenants (or with --share-arena) the one arena is announced by path and the one pool by the
arena socket; with tenants the caller's own arena and pool, each made at its first use, are
handed over by the arena socket to the caller's token and to no other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstore._proto import data_pb2
from kvstore.config import ServerConfig
from kvstore.errors import InvalidRequest
from kvstore.security.arena_socket import may_map_pool
from kvstore.security.identity import Identity
from kvstore.server.placement import Placement
from kvstore.server.placement.reads import AcquiredPage
from kvstore.server.tenancy import Tenancy
from kvstore.server.tenancy.owners import owner_for


class SharedMemory:
    """``arena_socket``: set with tenant arenas (where a caller fetches its own arena);
    ``pool_socket``: set with hbm (where an engine fetches its tenant's pool)."""

    def __init__(self, core: Placement, config: ServerConfig, tenancy: Tenancy, arena_socket: Path | None,
                 pool_socket: Path | None) -> None:
        self.core = core
        self.config = config
        self.tenancy = tenancy
        self.arena_socket = arena_socket
        self.pool_socket = pool_socket

    def describe(self, who: Identity, info: data_pb2.GetInfoResponse) -> None:
        """Fills GetInfo's arena and pool fields for ``who``."""
        arena = self.arena(who)
        if arena is not None and (arena.path or self.arena_socket is None):
            info.arena_path, info.arena_bytes, info.arena_token = arena.path, arena.size_bytes, arena.token
        elif arena is not None:
            info.arena_socket, info.arena_bytes, info.arena_token = str(self.arena_socket), arena.size_bytes, arena.token
        if self.pool_socket is not None and may_map_pool(who):
            info.pool_socket = str(self.pool_socket)

    def arena(self, who: Identity) -> Any:
        """The caller's arena (None: none); Allocate and Acquire name its token (client/restart.py)."""
        if who.via == "local" or self.config.security.share_arena:
            return self.core.arena_of()
        return self.core.arena_of(owner_for(who.tenant)) if self.arena_socket is not None else None

    def check_arena(self, who: Identity, namespace_id: bytes) -> None:
        """With an arena per tenant, Acquire answers slots in the arena of the namespace's
        owner: a reader of another tenant's namespace (admin) is told to use ReadPages (a
        caller that may not read it learns nothing here: it is answered as empty)."""
        owner = self.tenancy.owners.owner(namespace_id)
        if self.arena_socket is not None and owner not in (None, who.tenant) and self.tenancy.may_read(who, namespace_id):
            raise InvalidRequest("the namespace's pages are in its owner's arena, which this caller does not map; "
                                 "read them with ReadPages")

    def device(self, who: Identity, request: data_pb2.AcquireRequest) -> bool:
        """Whether Acquire copies the pages into the caller's pool: asked for, and the caller
        may map that pool (else no engine of it could read the copies)."""
        return request.device and self.pool_socket is not None and may_map_pool(who)

    def acquired(self, who: Identity, ident: bytes, pages: list[AcquiredPage], device: bool) -> data_pb2.AcquireResponse:
        """Acquire's answer: each page's offset in the caller's arena and, with ``device``, in
        its pool (only that of the caller's own tenant: the one its token was handed)."""
        arena = self.arena(who)
        token, offsets = self.core.promoter.placed(pages) if device else (b"", [None] * len(pages))
        pool = self.core.pool_of(owner_for(who.tenant)) if token else None
        if pool is None or pool.token != token:
            token, offsets = b"", [None] * len(pages)
        return data_pb2.AcquireResponse(
            lease_id=ident, page_bytes=pages[0].header.payload_bytes if pages else 0,
            arena_token=arena.token if arena is not None else b"", pool_token=token,
            pages=[data_pb2.AcquiredPage(key=p.key, offset=self.core.landing.at(p.slot).offset(p.slot), checksum=p.checksum,
                                         on_device=o is not None, device_offset=o or 0)
                   for p, o in zip(pages, offsets)],
        )
