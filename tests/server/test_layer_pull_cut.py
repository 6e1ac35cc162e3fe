"""A layer-wise handoff's pull at the decode node (``HandoffGate._fetch`` into ``LayerLanding``'s
slots, DESIGN §12.7) cut at its caller's time while the transport may still write into the slots.

Bug pinned here: ``_fetch`` kept the slots back only on a bare ``DestinationsInUse``. A fetch that
outlasts its own deadline (UCX's abort waits up to 2 s for its posted receives) is cut by the call
(``run_on(to_end=True)``), which raises TimeoutError *from* the transport's DestinationsInUse; that
was taken for a plain failure (no range landed) and the slots went back to the arena when the
handoff's marker went, while a late receive might still write into them.

Real servers, the holder's real TCP page server behind a link that keeps its bytes back; the
fetcher is the real TCP one, its deadline overrun and, cut, reporting what UCX's reports when its
receives stay posted (the one stand-in)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from test_caller_copy import holder_link
from test_remote_landing_tcp import _setup

from kvstore.cluster.cluster_errors import DestinationsInUse
from kvstore.cluster.page_fetch import FetchStatus
from kvstore.cluster.transport_tcp import TcpPageFetcher
from kvstore.server.cluster.landing import NodeLanding
from kvstore.server.layer_landings import LayerLanding
from kvstore.server.tenancy.gate_handoffs import HandoffGate

OVERRUN_S = 30.0  # the fetch's own deadline as the stand-in keeps it: far past its caller's


class StillPostedPastItsDeadline(TcpPageFetcher):
    """The TCP fetcher, outlasting its own deadline; cut, it reports what the UCX fetcher reports when
    its receives are still posted after its abort."""

    async def fetch(self, namespace_id: bytes, keys: Any, dests: Any, timeout_s: float, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().fetch(namespace_id, keys, dests, OVERRUN_S, *args, **kwargs)
        except asyncio.CancelledError:
            raise DestinationsInUse("receives still posted after abort; do not reuse the destinations") from None


async def test_a_layer_pull_cut_while_its_receives_are_still_posted_keeps_its_slots(server_factory, tmp_path: Path) -> None:
    holder, receiver, ns, keys, _ = await _setup(server_factory, tmp_path, 2)
    layout = holder.core.reads.layout_of(ns)
    layer = layout.page_bytes // layout.num_layers
    generation = receiver.core.directory.generation(ns)
    context = SimpleNamespace(time_remaining=lambda: 0.75)  # _fetch's own deadline 0.5 s, its call's 1.5 s: cut
    async with holder_link(holder, receiver, held=True, fetcher=StillPostedPastItsDeadline) as runtime:
        gate = SimpleNamespace(cluster=runtime)
        landing = LayerLanding(receiver.core)

        def pull(wanted: list[bytes], views: list[memoryview]) -> list[bool]:  # as HandoffGate.push_layers's
            result = HandoffGate._fetch(gate, "holder", ns, wanted, views, 0, layout.page_bytes, generation,  # type: ignore[arg-type]
                                        context)  # type: ignore[arg-type]
            return [s is FetchStatus.OK for s in result.statuses] if result is not None else []

        landed = await asyncio.to_thread(landing.land, ns, layout, keys, 0, layer, generation,
                                         lambda new: NodeLanding(receiver.core), pull)
        assert landed == 0
        landing.close()  # the handoff's marker went: every slot not kept back is given back
        assert receiver.core.view().num_allocations == 1, "slots the transport may still write into were given back"
