"""Review of ``caller_copy.copy_on_caller`` (a handoff's push at the decode node, DESIGN §12.7).

1. A copy cut at its caller's time whose transport reports ``DestinationsInUse`` (UCX: receives
   still posted after the abort) keeps its slots back, on the caller's thread and on the loop's
   ``fetch_from`` alike: ``run_on(to_end=True)`` raised a bare
   TimeoutError after the cut, hiding the transport's error, and the slots went back to the arena
   while the transfer might still write into them. The fetcher here is the real TCP one, reporting
   on a cut what UCX's reports when its receives stay posted.
2. An invalidation between the copy's read of the namespace's layout and of its generation binds
   the new generation here to the old generation's layout: the generation is read first (as
   ``RemoteTier._land_posted`` does), so such an allocation is refused as stale.
Real servers and a real TCP page server on the holder's core, as in test_caller_copy.py."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import grpc
import pytest
from test_caller_copy import _known_here, holder_link
from test_remote_landing import PAGE_BYTES, _found
from test_remote_landing_tcp import _setup

from kvstore._proto import common_pb2, data_pb2, data_pb2_grpc
from kvstore.cluster.cluster_errors import DestinationsInUse
from kvstore.cluster.transport_tcp import TcpPageFetcher
from kvstore.page import checksum
from kvstore.server.cluster.caller_copy import copy_on_caller
from kvstore.server.cluster.landing import NodeLanding

# another layout of the same page size (PAGE_BYTES): the namespace's next generation's
OTHER_LAYOUT = common_pb2.Layout(num_layers=4, kv_factor=2, num_kv_heads=1, head_dim=64, dtype="float16", page_tokens=16)


class StillPosted(TcpPageFetcher):
    """The TCP fetcher; cut, it reports what the UCX fetcher reports when receives are still posted after its abort."""

    async def fetch(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().fetch(*args, **kwargs)
        except asyncio.CancelledError:
            raise DestinationsInUse("receives still posted after abort; do not reuse the destinations") from None


def _store_as(address: str, ns: bytes, keys: list[bytes], pages: list[bytes], layout: common_pb2.Layout) -> None:
    with grpc.insecure_channel(address) as channel:
        stored = data_pb2_grpc.DataStub(channel).WritePages(iter([
            data_pb2.PageChunk(key=k, namespace_id=ns, layout=layout, page_bytes=PAGE_BYTES, checksum=checksum(p), data=p)
            for k, p in zip(keys, pages)]))
        assert stored.num_published == len(keys)


async def test_a_cut_copy_whose_receives_are_still_posted_keeps_its_slots(server_factory, tmp_path: Path) -> None:
    holder, receiver, ns, keys, _ = await _setup(server_factory, tmp_path, 3)
    _known_here(receiver, ns)
    async with holder_link(holder, receiver, held=True, fetcher=StillPosted) as runtime:  # the holder's bytes never come
        with pytest.raises(TimeoutError):  # the fetch's own deadline 10 s, its caller's 0.5 s: cut
            await asyncio.to_thread(copy_on_caller, runtime, "holder", ns, keys, PAGE_BYTES, 10.0, 0.5,  # type: ignore[arg-type]
                                    NodeLanding(receiver.core))
        assert receiver.core.view().num_allocations == 1, "slots the transport may still write into were given back"
        assert _found(receiver.address, ns, keys) == 0


async def test_a_cut_fetch_on_the_loop_whose_receives_are_still_posted_keeps_its_slots(server_factory, tmp_path: Path) -> None:
    """The same on ``RemoteTier.fetch_from``'s own path (the loop's: a replica, a fill, a push of
    more pages than one fetch), which gave the slots back whatever the transport said."""
    holder, receiver, ns, keys, _ = await _setup(server_factory, tmp_path, 3)
    _known_here(receiver, ns)
    async with holder_link(holder, receiver, held=True, fetcher=StillPosted) as runtime:
        copy = runtime.remote.fetch_from("holder", ns, keys, PAGE_BYTES, 10.0, "", NodeLanding(receiver.core), hashed=False)
        with pytest.raises(TimeoutError):
            await asyncio.to_thread(runtime.call, copy, 0.5, True)
        assert receiver.core.view().num_allocations == 1, "slots the transport may still write into were given back"
        assert _found(receiver.address, ns, keys) == 0


async def test_an_invalidation_after_the_layout_is_read_binds_no_old_layout(server_factory, tmp_path: Path) -> None:
    holder, receiver, ns, _, _ = await _setup(server_factory, tmp_path, 1)
    _known_here(receiver, ns)
    reads = receiver.core.reads
    old = reads.layout_of(ns)
    holder.core.invalidate(ns, [])  # the namespace's next generation, in another layout of the same page size
    keys = [secrets.token_bytes(16) for _ in range(3)]
    pages = [secrets.token_bytes(PAGE_BYTES) for _ in keys]
    _store_as(holder.address, ns, keys, pages, OTHER_LAYOUT)
    layout_of = reads.layout_of

    def overtaken(namespace_id: bytes) -> Any:
        """The layout as read, then the invalidation reaches this node (once)."""
        reads.layout_of = layout_of
        layout = layout_of(namespace_id)
        receiver.core.invalidate(namespace_id, [])
        return layout

    reads.layout_of = overtaken
    try:
        async with holder_link(holder, receiver) as runtime:
            held = await asyncio.to_thread(copy_on_caller, runtime, "holder", ns, keys, PAGE_BYTES, 10.0, 10.0,  # type: ignore[arg-type]
                                           NodeLanding(receiver.core))
            assert reads.layout_of(ns) != old, "the new generation is bound here to the old generation's layout"
            assert held == 0 and _found(receiver.address, ns, keys) == 0
            _store_as(receiver.address, ns, keys[:1], pages[:1], OTHER_LAYOUT)  # the new generation's writer is not refused
    finally:
        reads.layout_of = layout_of
