"""A third adversarial review of the layer-wise handoff pushes (DESIGN §12.7), as pulled over the
data plane (cd398a4, 2e8ca6d, 2641139): PushLayers names the prefill node's allocation and a range,
and the decode node fetches that range of the pages not committed yet (fetch_frames v4, PENDING).
Each test failed on that version (a range request its own decoder refuses; slots given back after a
UCX fetch said its destinations may still be written into) and passes since."""

from __future__ import annotations

import pytest

from kvstore.cluster.page_fetch import start_fetch
from kvstore.errors import InvalidRequest
from kvstore.page_wire.fetch_frames import FetchRequest

NS, KEY = b"\x01" * 16, b"\x02" * 16


@pytest.mark.parametrize(("dest", "offset", "page_bytes"), [
    (64, 32, 64),   # offset + length past the page's end
    (64, 0, 32),    # a range longer than the page
    (64, 64, 64),   # a range from the page's end on
])
def test_start_fetch_refuses_a_range_outside_the_page(dest: int, offset: int, page_bytes: int) -> None:
    """``start_fetch``'s contract: with ``offset`` or ``page_bytes``, a range of each ``page_bytes``
    page from ``offset`` on, as long as the destinations, "InvalidRequest otherwise". Whatever it
    builds must be a request the sender accepts: a range it cannot serve is the caller's bug,
    to be raised before anything is sent (as ``check_keys`` and the size check do)."""
    try:
        request, _, _ = start_fetch(1, NS, [KEY], [bytearray(dest)], offset=offset, page_bytes=page_bytes)
    except InvalidRequest:
        return
    FetchRequest.decode(request.encode())  # raises InvalidRequest: the sender would drop the connection


def test_slots_a_fetch_may_still_write_into_are_never_given_back(tmp_path) -> None:
    """transport_ucx's ``_abandon``: when posted receives do not finish after the abort it raises
    DestinationsInUse (a TransportError), "do not reuse the destinations". The layer pulls (and the rest's fetch) write
    into the decode node's slots; on that error the slots must not go back to the allocator (kept,
    or leaked, until the node restarts), else a late receive overwrites another page's slot."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from support.servers import make_config

    from kvstore.cluster.cluster_errors import DestinationsInUse
    from kvstore.cluster.page_fetch import FetchStatus
    from kvstore.page import LayoutDesc
    from kvstore.server.cluster.cluster_runtime import ClusterRuntime
    from kvstore.server.cluster.landing import NodeLanding
    from kvstore.server.layer_landings import LayerLanding
    from kvstore.server.placement import Placement
    from kvstore.server.tenancy.gate_handoffs import HandoffGate

    class _StuckReceives:
        async def fetch(self, namespace_id, keys, views, timeout_s, generation=0, **kw):
            raise DestinationsInUse("receives still posted after abort; do not reuse the destinations")

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    core = Placement(make_config(tmp_path))
    try:
        fetcher = _StuckReceives()
        runtime = SimpleNamespace(_loop=loop, node="c", peers=SimpleNamespace(get=lambda node: SimpleNamespace(fetcher=fetcher)))
        runtime.call = lambda coro, timeout_s, to_end=False: ClusterRuntime.call(runtime, coro, timeout_s, to_end)
        gate = SimpleNamespace(cluster=runtime)
        context = SimpleNamespace(time_remaining=lambda: 5.0)
        layout = LayoutDesc(4, 2, 2, 8, "float16", 4)
        ns, key, other = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
        gen = core.directory.generation(ns)

        seen: list[bytes] = []

        def pull(wanted: list[bytes], views: list[memoryview]) -> list[bool]:  # as HandoffGate.push_layers's
            seen.append(landing._slots[wanted[0]].allocation_id)
            result = HandoffGate._fetch(gate, "a", ns, wanted, views, 0, layout.page_bytes, gen, context,  # type: ignore[arg-type]
                                        b"\x07" * 16)
            return [s is FetchStatus.OK for s in result.statuses] if result is not None else []

        landing = LayerLanding(core)
        layer = layout.page_bytes // layout.num_layers
        assert landing.land(ns, layout, [key], 0, layer, gen, lambda new: NodeLanding(core), pull) == 0
        [allocation] = seen
        kept = core.leases.allocation(allocation)
        assert kept is not None, "the allocation a receive may still write into was given back"
        written = kept.slots[key]  # a late receive may still write here
        landing.close()  # the marker went: its slots are given back
        _, slots = core.allocate(ns, layout, [other], generation=gen)
        assert slots[0][1] != written, "a slot a receive may still write into was given to another page"
    finally:
        core.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
