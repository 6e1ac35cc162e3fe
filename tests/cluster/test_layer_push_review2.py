"""A second adversarial review of the layer-wise handoff pushes (DESIGN §12.7), reworked in
1178487: the decode node fetches each slot's rest from the holder while it holds the handoff's
LayerLanding lock, then commits or gives the slots back. Each test failed on that rework (the
fetch's call returned while the fetch still wrote into the slots; a slot of another layout
committed under it) and passes since."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

from kvstore.cluster.page_fetch import FetchResult, FetchStatus
from kvstore.page import LayoutDesc
from kvstore.server.cluster.cluster_runtime import ClusterRuntime
from kvstore.server.tenancy.gate_handoffs import MARGIN_S, HandoffGate


class _DrainingFetcher:
    """A data-plane fetcher as transport_tcp's is: cancelled past its deadline, it returns only once
    its receive thread stopped touching the destinations (``_stop`` waits for it, unbounded by
    design: "returning earlier hands back buffers it still writes"). Here the thread drains for
    ``drain_s`` after the cancel and writes its last bytes then."""

    def __init__(self, drain_s: float) -> None:
        self.drain_s = drain_s
        self.last_write: float | None = None

    async def fetch(self, namespace_id, keys, views, timeout_s, generation=0, **kw):
        try:
            await asyncio.sleep(timeout_s + 10)  # a stalled holder: the receive is still open
        except asyncio.CancelledError:
            await asyncio.sleep(self.drain_s)  # the receive thread drains what the kernel holds
            for view in views:
                view[:] = b"\xee" * len(view)  # ... into the caller's slot views
            self.last_write = time.monotonic()
            raise
        return FetchResult([FetchStatus.OK] * len(keys), checksums=[0] * len(keys))


def test_the_rest_fetch_returns_only_once_it_stopped_writing_into_the_slots() -> None:
    """LayerLanding's lock promises that no byte is written into a slot given back. The rest's fetch
    writes into the slots: ``_rest`` must not return (and let ``commit`` abort the allocation) while
    the fetch still runs, as the Push's own copy_from does (``call(..., to_end=True)``)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        fetcher = _DrainingFetcher(drain_s=0.6)
        runtime = SimpleNamespace(_loop=loop, node="c", peers=SimpleNamespace(get=lambda node: SimpleNamespace(fetcher=fetcher)))
        runtime.call = lambda coro, timeout_s, to_end=False: ClusterRuntime.call(runtime, coro, timeout_s, to_end)
        gate = SimpleNamespace(cluster=runtime)
        gate._fetch = lambda *args, **kw: HandoffGate._fetch(gate, *args, **kw)  # type: ignore[arg-type]
        context = SimpleNamespace(time_remaining=lambda: 0.1 + MARGIN_S)
        slot = bytearray(64)
        views = [memoryview(slot)[16:]]
        sums = HandoffGate._rest(gate, "a", b"\x01" * 16, [b"\x02" * 16], views, 16, 1, context)  # type: ignore[arg-type]
        returned = time.monotonic()
        assert sums == []
        time.sleep(1.0)  # the drain ends meanwhile
        assert fetcher.last_write is not None
        assert fetcher.last_write <= returned, "the fetch wrote into the slot after _rest returned (slots given back by then)"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_page_is_committed_with_the_holders_layout(tmp_path) -> None:
    """An abandoned save lands layer 0 under layout A; the save is retried under layout B (same
    page size) and stored at the holder; B's range at 0 is dropped (the slot keeps A). The page's
    leading bytes are the same under both (an all-zero page: padding, an empty cache). At the Push
    the rest comes from the holder and the whole page's hash matches its checksum: LayerLanding
    commits the slot, as a page of layout A. A checked copy of the holder's page must carry the
    holder's layout (else a reader of B gets an 'another layout' miss, a reader of A a page that is not)."""
    from support.servers import make_config

    from kvstore.page import checksum
    from kvstore.server.cluster.landing import NodeLanding
    from kvstore.server.layer_landings import LayerLanding
    from kvstore.server.placement import Placement

    core = Placement(make_config(tmp_path))
    a = LayoutDesc(4, 2, 2, 8, "float16", 4)
    b = LayoutDesc(2, 2, 4, 8, "float16", 4)
    assert a.page_bytes == b.page_bytes and a != b
    ns, key = b"\x01" * 16, b"\x02" * 16
    gen = core.directory.generation(ns)
    stored = bytes(b.page_bytes)  # the holder's page, layout B
    layer_a = a.page_bytes // a.num_layers
    landing = LayerLanding(core)

    def pull(length: int) -> Callable[[list[bytes], list[memoryview]], list[bool]]:
        def fetched(keys: list[bytes], views: list[memoryview]) -> list[bool]:
            for view in views:
                view[:] = stored[:length]
            return [True] * len(keys)
        return fetched

    assert landing.land(ns, a, [key], 0, layer_a, gen, lambda new: NodeLanding(core), pull(layer_a)) == 1
    layer_b = b.page_bytes // b.num_layers
    assert landing.land(ns, b, [key], 0, layer_b, gen, lambda new: NodeLanding(core), pull(layer_b)) == 0

    def rest(keys: list[bytes], views: list[memoryview], offset: int) -> list[int]:
        for view in views:
            view[:] = stored[offset:]
        return [checksum(stored)] * len(keys)

    try:
        committed = landing.commit([key], rest)
        lease, pages = core.acquire(ns, [key], 1000)
        core.release(lease)
        assert committed == 0 or pages[0].header.layout == b, f"committed as {pages[0].header.layout}, the holder stored {b}"
    finally:
        landing.close()
        core.close()
