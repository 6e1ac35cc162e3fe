"""A small unhashed copy from one holder (a handoff's push at the decode node, DESIGN §12.7) with
its landing's allocation and commit on the calling gRPC thread, only the transfer on the cluster
loop. Why: ``RemoteTier.fetch_from`` hops from the loop to a worker thread and back twice around the
transfer (allocate, commit), six thread wake-ups with the caller's own; a one-page handoff's copy
took 2.1 ms (median, two idle cores) of its ~4.2 ms that way, 1.6 ms this way, where the handoff
goal allows ~5 ms in all. What lands is committed as ``fetch_from`` commits it (unhashed, noted as
from its holder)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvstore.errors import KVStoreError, StaleGeneration
from kvstore.server.cluster.landing import Landing, NodeLanding
from kvstore.server.cluster.remote import FETCH_PAGES, RemoteTier, destinations_in_use

if TYPE_CHECKING:
    from kvstore.server.cluster.cluster_runtime import ClusterRuntime

logger = logging.getLogger(__name__)


def copy_on_caller(runtime: ClusterRuntime, holder: str, namespace_id: bytes, keys: list[bytes], page_bytes: int,
                   timeout_s: float, wait_s: float, landing: Landing | None = None) -> int | None:
    """The leading pages of ``keys`` held here once the ones missing are fetched from ``holder``
    (a prefix: up to the first that found no room or did not arrive); None where this path does
    not apply and the caller takes ``fetch_from``'s: the gRPC data plane, more than one fetch's
    pages, or a namespace whose layout this node does not know yet (the holder is asked it there)."""
    remote, core, landing = runtime.remote, runtime.core, landing or NodeLanding(runtime.core)
    held = remote.local_prefix(namespace_id, keys)
    want = keys[held:]
    if not want:
        return held
    peer = runtime.peers.get(holder)
    # the generation before the layout (as _land_posted): an invalidation between them drops the layout, or the
    # allocation is refused as stale; the other way the new generation could be bound to the old one's layout
    generation = core.directory.generation(namespace_id)  # the holder sends only pages of this one
    layout = core.reads.layout_of(namespace_id)
    if peer is None or peer.fetcher is None or len(want) > FETCH_PAGES or layout is None:
        return None
    if layout.page_bytes != page_bytes:
        return held
    deadline = time.monotonic() + timeout_s
    try:
        allocation_id, slots = landing.allocate(namespace_id, layout, want, generation)
    except KVStoreError as exc:  # full of leased pages, the quota, another layout or generation
        logger.info("no landing room for %d handed-off pages: %s", len(want), exc)
        return held
    to_fetch = [k for k, slot in slots if slot is not None]
    sums: list[int] = []
    try:
        if to_fetch:
            views = [core.slot_view(allocation_id, k) for k in to_fetch]
            try:
                fetch = RemoteTier.fetch_checked(peer, namespace_id, to_fetch, views, deadline, generation, hashed=False)
                sums = runtime.call(fetch, wait_s, to_end=True)  # to its end: nothing writes into the views once it returns or raises
            finally:
                for view in views:
                    view.release()
    except BaseException as exc:
        if not destinations_in_use(exc):
            core.abort(allocation_id)
        else:  # UCX receives still posted: the slots stay the allocation's until its ttl (bytes may still land there)
            logger.warning("a cut handoff copy's slots are kept back until their allocation expires: %s", exc)
        raise
    arrived = to_fetch[: len(sums)]
    try:
        remote.commit_landed(landing, allocation_id, arrived, sums, (namespace_id, holder))  # noted unchecked, as fetch_from's
        remote.num_fetched += len(arrived)  # as _commit counts: not the pages an invalidation dropped
    except StaleGeneration as exc:  # an invalidation since the allocation: the old generation's bytes are never stored
        logger.info("%d handed-off pages dropped: %s", len(arrived), exc)
    return remote.local_prefix(namespace_id, keys)

