"""A decode worker's handed-off pages, leased in the node's shared-memory arena (pd_worker.py).

More: client/adapters/vllm/README.md (### pd_leases.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvstore.client.adapters.vllm.layout import RequestKV
from kvstore.client.adapters.vllm.leased_copy import copy_verified
from kvstore.client.arena import ArenaMap
from kvstore.client.client import KVStoreClient
from kvstore.client.transport import ShmTransport
from kvstore.errors import KVStoreError
from kvstore.types import KVLayout

MARGIN_S = 1.0  # a lease this close to its expiry is not copied from (the copy itself takes time)


@dataclass
class Taken:
    """Acquire answers of the leading handed-off pages, in order, with the arena mapping their
    offsets are in (held: ``give_back`` drops it)."""

    keys: list[bytes] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)
    lease_ids: list[bytes] = field(default_factory=list)
    arenas: list[ArenaMap] = field(default_factory=list)  # one hold per acquire answer
    page_arenas: list[ArenaMap] = field(default_factory=list)  # the mapping each page's offset is in
    expires_at: float = 0.0  # monotonic: the first lease's end
    given_back: bool = False

    @property
    def num_pages(self) -> int:
        return len(self.offsets)


def arena_of(client: KVStoreClient) -> ShmTransport | None:
    """The client's shared-memory transport, or None (a store on another host: pages by get)."""
    transport = client.transport
    return transport if isinstance(transport, ShmTransport) else None


async def take(client: KVStoreClient, transport: ShmTransport, keys: list[bytes]) -> Taken:
    """Leases the stored prefix of ``keys`` (every page a wait handed: the marker keeps them
    until acquired), in batches the server takes. Cancelled or failed part way, what was
    granted is given back before the error goes on."""
    taken = Taken(expires_at=time.monotonic() + client.lease_ms / 1000)
    try:
        for start in range(0, len(keys), client.max_pages):
            batch = keys[start : start + client.max_pages]
            acq = await transport.granted(transport.acquire(batch), lambda a: transport.release(a.lease_id))
            taken.lease_ids.append(acq.lease_id)
            arena = await transport.mapping(acq, lambda lid=acq.lease_id: _forget(transport, taken, lid))
            taken.arenas.append(arena)
            taken.page_arenas += [arena] * len(acq.pages)
            taken.keys += batch[: len(acq.pages)]
            taken.offsets += [int(p.offset) for p in acq.pages]
            taken.checksums += [int(p.checksum) for p in acq.pages]
            if len(acq.pages) < len(batch):
                break
    except BaseException:
        await _release_all(transport, taken, [])
        raise
    return taken


async def _forget(transport: ShmTransport, taken: Taken, lease_id: bytes) -> None:
    """An acquire whose arena cannot be mapped: its lease goes back now (not in ``taken``'s arenas)."""
    taken.lease_ids.remove(lease_id)
    await transport.release(lease_id)


def copy_into(taken: Taken, kv: RequestKV, first: int, count: int, layout: KVLayout) -> tuple[int, list[bytes]]:
    """Copies pages ``first .. first + count`` of ``taken`` (at most what it holds) into ``kv``'s
    pages 0..; returns (the leading pages copied and verified, the keys of a page that failed).
    Into a CPU cache one native call copies and checksums every page; otherwise each page is
    checked first and one that fails is not copied."""
    count = max(0, min(count, taken.num_pages - first))
    if count == 0 or time.monotonic() > taken.expires_at - MARGIN_S or not taken.arenas:
        return 0, []
    # one mapping per page, the same unless the server restarted between two acquires
    sources = list(zip(taken.page_arenas[first : first + count], taken.offsets[first : first + count]))
    bad = copy_verified(kv, layout, sources, taken.checksums[first : first + count], on_device=False)
    if bad is None:
        return count, []
    return bad, [taken.keys[first + bad]]


def _let_go(taken: Taken) -> bool:
    """Drops ``taken``'s arena holds; False when it was given back already (its leases are released once)."""
    if taken.given_back:
        return False
    taken.given_back = True
    for arena in taken.arenas:
        arena.drop()
    taken.arenas, taken.page_arenas = [], []
    return True


def give_back(client: KVStoreClient, transport: ShmTransport | None, taken: Taken, failed: list[bytes]) -> None:
    """Releases every lease of ``taken`` in the background (``failed``: keys whose copy failed its
    checksum, for the server to check) and drops the arena holds; once only. Without a transport
    (no client connected) only the holds go: the leases expire."""
    if not _let_go(taken) or transport is None:
        return
    for lease_id in taken.lease_ids:
        try:
            client.runtime.submit(transport.release(lease_id, failed))
        except KVStoreError:  # the client closed meanwhile: the lease ends at its ttl
            return


async def _release_all(transport: ShmTransport, taken: Taken, failed: list[bytes]) -> None:
    """``give_back`` on the runtime loop itself (a take that failed part way)."""
    if _let_go(taken):
        await asyncio.gather(*(transport.release(lease_id, failed) for lease_id in taken.lease_ids))

