"""What this node's UCX or TCP page server sends from: the landing tier, through the core's acquire
(so a page on SSD only is read up first, and every page sent is leased, never evicted
mid-send). One lease per request, released when the server has released every page."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvstore.cluster.page_fetch import SourcePage
from kvstore.errors import KVStoreError
from kvstore.server.placement import Placement

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 20.0  # a page server's send deadline, from just after the acquire that pins what it sends
LEASE_MS = int(SEND_TIMEOUT_S * 1000) + 10_000  # that pin: longer, so a reader that stalls is cut off before the pin
# could lapse mid-send (the servers' own default send timeout, 30 s, equalled the pin's 30 s)


class CorePageSource:
    def __init__(self, core: Placement) -> None:
        self.core = core

    async def open_pages(self, namespace_id: bytes, keys: Sequence[bytes], generation: int = 0) -> list[SourcePage | None]:
        """The pages of ``keys`` leased for sending, of the receiver's ``generation`` only: a
        receiver in an older one gets none (it would store them under a generation that is
        over); one in a newer makes this node enter it first (nothing of the older is sent).
        One hop to a worker thread for the check and the acquire together."""
        return await asyncio.to_thread(self.open_pages_now, namespace_id, keys, generation)

    def open_pages_now(self, namespace_id: bytes, keys: Sequence[bytes], generation: int = 0) -> list[SourcePage | None]:
        """As ``open_pages``, on the calling thread (it may block: a page on SSD only is read up)."""
        try:
            self.core.read_generation(namespace_id, generation)
            lease_id, pages = self.core.acquire(namespace_id, list(keys), LEASE_MS, False)
        except KVStoreError as exc:  # full of leased pages, bad keys, another generation: answered as missing
            logger.info("cannot serve %d pages to a peer: %s", len(keys), exc)
            return [None] * len(keys)
        if not pages:
            self.core.release(lease_id)
            return [None] * len(keys)
        left = [len(pages)]

        def release() -> None:
            left[0] -= 1
            if left[0] == 0:
                self.core.release(lease_id)

        out: list[SourcePage | None] = [
            SourcePage(self.core.read_view(p), p.checksum, release, p.header.layout,
                       damaged=lambda reason, p=p: self.core.reads.quarantine_landing(p.header, reason, p.slot))
            for p in pages]
        return out + [None] * (len(keys) - len(pages))

    def open_pending_now(self, namespace_id: bytes, keys: Sequence[bytes], allocation: bytes,
                         generation: int = 0) -> list[SourcePage | None]:
        """The slots of ``allocation``, not committed yet, for ``keys`` (a handoff's layers as the
        prefill computes them, DESIGN §12.7; fetch_frames.PENDING): none unless it is of the
        namespace and of the receiver's ``generation``. Nothing pins a slot: the receiver checks the
        page it assembles against the stored page's checksum, so bytes of a slot given back meanwhile
        are never committed there."""
        core = self.core
        with core.keeper.lock:
            alloc = core.leases.allocation(allocation)
            if alloc is None or alloc.namespace_id != namespace_id or alloc.generation != generation:
                return [None] * len(keys)
            offsets = [alloc.slots.get(key) for key in keys]
            layout = alloc.layout
        out: list[SourcePage | None] = []
        for key, slot in zip(keys, offsets):
            if slot is None:
                out.append(None)
                continue
            try:
                view = core.slot_view(allocation, key)
            except KVStoreError:  # committed or given back since: the rest is not served
                out += [None] * (len(keys) - len(out))
                break
            out.append(SourcePage(view, 0, view.release, layout))
        return out

