"""The source checks (``cluster/source_checks.py``: a copy landed unhashed that a reader found
damaged has the node it came from check its own) are cancelled when the node leaves: one in
flight towards a source that does not answer would otherwise hold the peer's fetcher until its
own 10 s deadline, and ``ClusterRuntime._stop`` waits for the fetchers (``peers.close()``)
before it closes the page server and etcd. And at most ``MAX_CHECKS`` run at once (each holds a
page of memory): past it the damaged copy is still dropped, its source not asked. Real servers
over loopback; the runtime is a stub carrying only what ``_stop`` touches, as
tests/cluster/test_publisher_closed_channel.py does."""

from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace

from support.servers import flip_arena_byte
from test_remote_landing import PAGE_BYTES
from test_remote_landing_tcp import Peer, _checks_done, _pages_at, _setup
from test_remote_landing_unhashed import _serve

from kvstore.cluster.transport_tcp import TcpPageServer
from kvstore.server.cluster.cluster_runtime import ClusterRuntime
from kvstore.server.cluster.remote import RemoteTier
from kvstore.server.cluster.source import CorePageSource
from kvstore.server.cluster.source_checks import MAX_CHECKS


async def test_leaving_does_not_wait_for_a_source_check_to_time_out(server_factory, tmp_path) -> None:
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 2)
    server = TcpPageServer(CorePageSource(holder.core))
    port = await server.start()
    silent = socket.create_server(("127.0.0.1", 0))  # connects (the kernel's backlog), never answers: a stalled holder
    try:
        landed_from = Peer(port)
        stalled = Peer(silent.getsockname()[1])  # the holder as the runtime reaches it once it stalled
        tier = RemoteTier(receiver.core, {"holder": stalled}, None, "tcp")  # type: ignore[arg-type]
        assert await tier._fetch_posted(landed_from, ns, keys, PAGE_BYTES, 10.0) == 2  # type: ignore[arg-type]
        await landed_from.fetcher.close()
        flip_arena_byte(receiver, receiver.core.where(keys[1])["host"] + 3)
        assert await asyncio.to_thread(_pages_at, receiver.address, ns, keys) == pages[0]
        for _ in range(200):  # the check is under way, towards the stalled holder
            if tier.source_checks.num_asked:
                break
            await asyncio.sleep(0.01)
        assert tier.source_checks.num_asked == 1 and tier.source_checks._tasks

        async def close_peers() -> None:
            await stalled.fetcher.close()

        runtime = ClusterRuntime.__new__(ClusterRuntime)  # what _stop touches, no more
        runtime.publisher = None
        runtime.membership = None
        runtime._tasks = set()
        runtime.peers = SimpleNamespace(close=close_peers)
        runtime._page_server = None
        runtime.remote = tier
        t0 = time.monotonic()
        await asyncio.wait_for(runtime._stop(), 30)
        took = time.monotonic() - t0
        assert took < 2.0, f"leaving waited {took:.1f} s for a source check to time out (not cancelled with the runtime's tasks)"
        assert not tier.source_checks._tasks, "a source check outlived the node's leaving"
    finally:
        silent.close()
        await server.close()


async def test_at_most_MAX_CHECKS_source_checks_run_at_once(server_factory, tmp_path) -> None:
    n = MAX_CHECKS + 3
    holder, receiver, ns, keys, _ = await _setup(server_factory, tmp_path, n)
    server = TcpPageServer(CorePageSource(holder.core))
    port = await server.start()
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        landed_from, stalled = Peer(port), Peer(silent.getsockname()[1])
        tier = RemoteTier(receiver.core, {"holder": stalled}, None, "tcp")  # type: ignore[arg-type]
        assert await tier._fetch_posted(landed_from, ns, keys, PAGE_BYTES, 10.0) == n  # type: ignore[arg-type]
        await landed_from.fetcher.close()
        for key in keys:  # every copy damaged, each read alone: n drops, n source checks asked for
            flip_arena_byte(receiver, receiver.core.where(key)["host"] + 11)
            assert await asyncio.to_thread(_pages_at, receiver.address, ns, [key]) == b""
        for _ in range(200):
            if tier.source_checks.num_asked + tier.source_checks.num_skipped == n:
                break
            await asyncio.sleep(0.01)
        assert tier.source_checks.num_skipped == n - MAX_CHECKS and len(tier.source_checks._tasks) <= MAX_CHECKS
        assert all(key in {q.key for q in receiver.core.quarantined()} for key in keys)  # dropped here all the same
        await tier.close()
        assert not tier.source_checks._tasks
        await stalled.fetcher.close()
    finally:
        silent.close()
        await server.close()


async def test_a_tier_that_closed_asks_no_more_checks_and_a_rejoin_asks_once(server_factory, tmp_path) -> None:
    """A node that leaves and joins again builds a new remote tier on the same core: the closed
    one's listener goes with it (else it asked every source once more, for as long as its loop ran)."""
    holder, receiver, ns, keys, pages = await _setup(server_factory, tmp_path, 2)
    server, port = await _serve("tcp", holder)
    try:
        peer = Peer(port)
        left = RemoteTier(receiver.core, {"holder": peer}, None, "tcp")  # type: ignore[arg-type]
        await left.close()
        joined = RemoteTier(receiver.core, {"holder": peer}, None, "tcp")  # type: ignore[arg-type]
        assert await joined._fetch_posted(peer, ns, keys, PAGE_BYTES, 10.0) == 2  # type: ignore[arg-type]
        flip_arena_byte(receiver, receiver.core.where(keys[1])["host"] + 3)
        assert await asyncio.to_thread(_pages_at, receiver.address, ns, keys) == pages[0]
        await _checks_done(joined)
        assert joined.source_checks.num_asked == 1
        assert left.source_checks.num_asked == 0, "the closed tier's listener still asked the source"
        await joined.close()
        await peer.fetcher.close()
    finally:
        await server.close()


async def test_a_reader_that_took_the_listener_before_the_close_starts_no_check_after_it(server_factory, tmp_path) -> None:
    """``UncheckedCopies.damaged`` calls its listeners outside its lock, from a copy of the list
    taken under it: a reader's thread may call a tier's listener just after that tier closed (the
    node left). No check may start then: nothing would cancel or await it, and it would use the
    fetchers the leave closes."""
    _, receiver, ns, keys, _ = await _setup(server_factory, tmp_path, 1)
    tier = RemoteTier(receiver.core, {"holder": Peer(1)}, None, "tcp")  # type: ignore[arg-type]
    taken = list(receiver.core.reads.unchecked._listeners)  # a reader's copy, taken before the close
    await tier.close()
    header = SimpleNamespace(namespace_id=ns, key=keys[0], payload_bytes=PAGE_BYTES)
    for check in taken:
        await asyncio.to_thread(check, header, "holder")  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert tier.source_checks.num_asked == 0 and not tier.source_checks._tasks, "a check started after its tier closed"
