"""Handoffs on one server (DESIGN §12.7): without a cluster the prefill and decode sides share the node,
and Complete marks the handoff here. Bad input is a clear error that leaves nothing; the table of
markers is bounded per tenant; a wait for an id nobody completed ends at its deadline."""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time

import pytest
import torch
from support.handoffs import leases, until
from support.kv import random_kv

from kvstore._proto import data_pb2, handoff_pb2
from kvstore.client import KVStoreClient, new_handoff_id
from kvstore.errors import InvalidRequest, LimitExceeded


def _tokens(seed: int, pages: int, page_tokens: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (pages * page_tokens,), generator=g).tolist()


async def test_a_handoff_on_one_node_is_complete_at_once_and_its_pins_go_with_the_read(server, ns, layout) -> None:
    tokens = _tokens(1, 4, layout.page_tokens)
    kv = random_kv(layout, len(tokens), seed=1)
    async with KVStoreClient(server.address, ns) as client:
        handoff = new_handoff_id()
        assert len(handoff) == 32 and handoff != new_handoff_id()
        await client.handoff_open(handoff, None)
        assert await client.put(tokens, kv) == len(tokens)
        assert await client.handoff_complete(handoff, tokens) == len(tokens)
        assert await leases(client) == 1 and len(server.handoffs) == 1
        hit = await client.handoff_wait(handoff, tokens, deadline_s=2.0)
        assert hit.num_tokens == len(tokens)
        out = torch.zeros_like(kv)
        assert await client.get(hit, out) == len(tokens)
        assert torch.equal(out, kv)
        assert await leases(client) == 0 and len(server.handoffs) == 0


async def test_a_wait_for_pages_nobody_stores_ends_at_its_deadline_with_nothing_left(server, ns, layout) -> None:
    tokens = _tokens(2, 2, layout.page_tokens)
    async with KVStoreClient(server.address, ns) as client:
        started = time.monotonic()
        hit = await client.handoff_wait(new_handoff_id(), tokens, deadline_s=0.3)
        assert hit.num_tokens == 0 and 0.3 <= time.monotonic() - started < 1.5
        assert len(server.handoffs) == 0 and await leases(client) == 0


async def test_bad_input_is_refused_and_leaves_nothing(server, ns, layout) -> None:
    tokens = _tokens(3, 2, layout.page_tokens)
    async with KVStoreClient(server.address, ns) as client:
        for bad in ("", "xyz", "00" * 15, "00" * 17):
            with pytest.raises(InvalidRequest, match="handoff_id"):
                await client.handoff_open(bad, None)
        with pytest.raises(InvalidRequest, match="ttl_s"):
            await client.handoff_open(new_handoff_id(), None, ttl_s=0)
        with pytest.raises(InvalidRequest, match="deadline_s"):
            await client.handoff_wait(new_handoff_id(), tokens, deadline_s=float("inf"))
        request = handoff_pb2.WaitHandoffRequest(namespace_id=ns.namespace_id, handoff_id=b"x" * 16, keys=client.keys(tokens))
        with pytest.raises(InvalidRequest, match="deadline_ms"):  # 0: every wait has a deadline
            await client._call(client.runtime.handoff.Wait, request)
        request = handoff_pb2.WaitHandoffRequest(namespace_id=b"short", handoff_id=b"x" * 16, keys=client.keys(tokens),
                                                 deadline_ms=100)
        with pytest.raises(InvalidRequest, match="namespace_id"):
            await client._call(client.runtime.handoff.Wait, request)
        request = handoff_pb2.OpenHandoffRequest(namespace_id=ns.namespace_id, handoff_id=b"x" * 16, ttl_ms=10**9)
        with pytest.raises(InvalidRequest, match="ttl_ms"):
            await client._call(client.runtime.handoff.Open, request)
        push = handoff_pb2.PushHandoffRequest(namespace_id=ns.namespace_id, handoff_id=b"x" * 16, keys=client.keys(tokens),
                                              holder="a", page_bytes=1)
        with pytest.raises(InvalidRequest, match="cluster mode"):  # no tenants here: the caller has every right
            await client._call(client.runtime.handoff.Push, push)
        assert len(server.handoffs) == 0 and await leases(client) == 0


async def test_the_markers_a_tenant_holds_are_bounded(server, ns, layout) -> None:
    """Past the bound, RESOURCE_EXHAUSTED for that caller: nothing made, nothing pinned."""
    server.handoffs.per_tenant = 2
    tokens = _tokens(4, 2, layout.page_tokens)
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, random_kv(layout, len(tokens), seed=4)) == len(tokens)
        for _ in range(2):
            assert await client.handoff_complete(new_handoff_id(), tokens) == len(tokens)
        with pytest.raises(LimitExceeded, match="handoffs"):
            await client.handoff_complete(new_handoff_id(), tokens)
        assert len(server.handoffs) == 2 and await leases(client) == 2


async def test_an_acquire_of_the_handed_pages_takes_them_over(server, ns, layout) -> None:
    """A waiter acquires its hit (Data.Acquire) and copies under that lease: the handoff's own
    pins go once the waiter's lease holds every page it was handed."""
    tokens = _tokens(5, 3, layout.page_tokens)
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, random_kv(layout, len(tokens), seed=5)) == len(tokens)
        handoff = new_handoff_id()
        assert await client.handoff_complete(handoff, tokens) == len(tokens)
        hit = await client.handoff_wait(handoff, tokens, deadline_s=1.0)
        assert hit.num_tokens == len(tokens) and await leases(client) == 1
        lease = await client._call(client.runtime.data.Acquire,
                                   data_pb2.AcquireRequest(namespace_id=ns.namespace_id, keys=hit.keys, ttl_ms=5000))
        assert len(lease.pages) == hit.num_pages and await leases(client) == 1 and len(server.handoffs) == 0
        await client._call(client.runtime.data.Release, data_pb2.ReleaseRequest(lease_id=lease.lease_id))
        assert await leases(client) == 0


async def test_a_complete_after_the_decode_side_read_the_pages_pins_nothing(server, ns, layout) -> None:
    """Bug: a decode's wait may come before the prefill's Complete (the prefill returns its
    kv_transfer_params when it finishes; its worker completes a step later, once its saves end). With the
    pages stored already the wait answered at once and the read took them over; the Complete that came
    next made the marker again and pinned its pages under a lease nobody would take over, held to the
    handoff's ttl (30 s). A handoff taken over stays taken over: a late Complete answers, pins nothing."""
    tokens = _tokens(9, 3, layout.page_tokens)
    kv = random_kv(layout, len(tokens), seed=9)
    async with KVStoreClient(server.address, ns) as client:
        handoff = new_handoff_id()
        await client.handoff_open(handoff, None)
        assert await client.put(tokens, kv) == len(tokens)
        hit = await client.handoff_wait(handoff, tokens, deadline_s=2.0)
        out = torch.zeros_like(kv)
        assert await client.get(hit, out) == len(tokens) and torch.equal(out, kv)
        assert await leases(client) == 0 and len(server.handoffs) == 0
        assert await client.handoff_complete(handoff, tokens) == len(tokens)
        assert await leases(client) == 0 and len(server.handoffs) == 0, "the late Complete pinned the pages again"
        again = await client.handoff_wait(handoff, tokens, deadline_s=2.0)  # a wait after it: as before, handed
        assert again.num_tokens == len(tokens) and await client.get(again, out) == len(tokens)
        assert await leases(client) == 0 and len(server.handoffs) == 0


async def test_waits_take_stream_slots_so_unary_calls_keep_their_threads(server_factory, ns, layout) -> None:
    """A wait holds its thread to its deadline: it counts as a stream (``--max-streams``), a tenant
    holding at most half of them; past that RESOURCE_EXHAUSTED, and a lookup is answered meanwhile."""
    server = server_factory(max_streams=2, max_subscribers=1, workers=2)
    tokens = _tokens(6, 2, layout.page_tokens)
    async with KVStoreClient(server.address, ns) as client:
        first = asyncio.ensure_future(client.handoff_wait(new_handoff_id(), tokens, deadline_s=4.0))
        await until(lambda: server.streams.num_open == 1, "the first wait did not take its slot")
        with pytest.raises(LimitExceeded, match="handoff waits"):
            await client.handoff_wait(new_handoff_id(), tokens, deadline_s=1.0)
        assert (await asyncio.wait_for(client.lookup(tokens), 5.0)).num_tokens == 0
        assert not first.done(), "the lookup was answered while the wait held its slot"
        assert (await first).num_tokens == 0
        assert server.streams.num_open == 0 and len(server.handoffs) == 0


async def test_a_cancelled_wait_gives_its_slot_back_at_once(server, ns, layout) -> None:
    tokens = _tokens(7, 2, layout.page_tokens)
    async with KVStoreClient(server.address, ns) as client:
        waiting = asyncio.ensure_future(client.handoff_wait(new_handoff_id(), tokens, deadline_s=30.0))
        await until(lambda: server.streams.num_open == 1, "the wait did not take its slot")
        waiting.cancel()
        started = time.monotonic()
        while server.streams.num_open and time.monotonic() - started < 10:
            await asyncio.sleep(0.05)
        assert server.streams.num_open == 0 and time.monotonic() - started < 10.0  # not at its 30 s deadline
        assert len(server.handoffs) == 0


async def test_a_wait_cancelled_with_pages_held_leaves_no_pin(server, ns, layout) -> None:
    """Bug: a wait whose caller left (cancelled: the decode side gave up, the request was aborted)
    still handed the pages held so far, pinned for a caller that would never acquire them, until
    the handoff's ttl (30 s here). The caller left: nothing is handed, the pins go at once."""
    tokens = _tokens(8, 2, layout.page_tokens)
    async with KVStoreClient(server.address, ns) as client:
        handoff = new_handoff_id()
        await client.handoff_open(handoff, None, ttl_s=30.0)
        first = tokens[: layout.page_tokens]
        assert await client.put(first, random_kv(layout, len(first), seed=8)) == len(first)
        waiting = asyncio.ensure_future(client.handoff_wait(handoff, tokens, deadline_s=30.0))
        await asyncio.sleep(0.5)
        waiting.cancel()
        started = time.monotonic()
        while (server.streams.num_open or len(server.handoffs) or await leases(client)) and time.monotonic() - started < 5:
            await asyncio.sleep(0.05)
        assert server.streams.num_open == 0 and len(server.handoffs) == 0
        assert await leases(client) == 0, "the pages of a wait nobody reads are let go"


async def test_a_wait_that_left_drops_no_pin_another_wait_was_handed(server, ns, layout) -> None:
    """Bug: the wait whose caller left decided under the lock that no other wait read its marker,
    then dropped it, with its pins, after letting the lock go: a second wait of the handoff that
    came in between was handed the pages, and their pins went under it (until its acquire an
    eviction could take them). The decision is made again where the marker is dropped. Here the
    leaving wait's thread is held between the two (as the scheduler may hold it)."""
    tokens = _tokens(9, 2, layout.page_tokens)
    kv = random_kv(layout, len(tokens), seed=9)
    markers = server.handoffs
    drop, entered, release = markers._drop, threading.Event(), threading.Event()
    wait, waiting = markers.wait, threading.Event()

    def seen_wait(*args: object, **kwargs: object) -> int:
        waiting.set()
        return wait(*args, **kwargs)

    def held_drop(*args: object, **kwargs: object) -> object:
        if sys._getframe(1).f_code.co_name == "_left":  # the leaving wait's drop: held until the second wait has its answer
            entered.set()
            release.wait(10)
        return drop(*args, **kwargs)

    markers._drop, markers.wait = held_drop, seen_wait  # type: ignore[method-assign]
    try:
        async with KVStoreClient(server.address, ns) as client:
            handoff = new_handoff_id()
            await client.handoff_open(handoff, None, ttl_s=30.0)
            first = tokens[: layout.page_tokens]
            assert await client.put(first, kv[:, :, : len(first)].contiguous()) == len(first)
            leaving = asyncio.ensure_future(client.handoff_wait(handoff, tokens, deadline_s=30.0))
            await until(waiting.is_set, "the wait did not begin")
            leaving.cancel()
            started = time.monotonic()
            await until(entered.is_set, "the cancelled wait did not leave")
            assert await client.put(tokens, kv) == len(tokens)
            assert await client.handoff_complete(handoff, tokens) == len(tokens)
            hit = await client.handoff_wait(handoff, tokens, deadline_s=5.0)
            assert hit.num_tokens == len(tokens)
            release.set()
            while server.streams.num_open:  # the left wait's slot goes once its drop has run
                assert time.monotonic() - started < 20, "the left wait did not end"
                await asyncio.sleep(0.02)
            assert len(markers) == 1 and await leases(client) == 1, "the pages handed to the second wait stay pinned"
            out = torch.zeros_like(kv)
            assert await client.get(hit, out) == len(tokens) and torch.equal(out, kv)
            assert len(markers) == 0 and await leases(client) == 0, "its acquire lets them go: nothing is left"
    finally:
        release.set()
        markers._drop, markers.wait = drop, wait  # type: ignore[method-assign]


async def test_a_wait_that_opened_the_marker_keeps_it_from_a_wait_that_left(server, ns, layout) -> None:
    """Bug: a Wait counted as a reader of its marker only once its wait began, not when it opened
    the marker: a wait that left in between dropped the marker as read by no other, and the second
    wait then answered nothing at once, its pages complete and held here moments later (a decode
    that recomputes what it was handed). The marker is opened and read in one step now. Here the
    second wait's thread is held between the two (as the scheduler may hold it)."""
    tokens = _tokens(10, 2, layout.page_tokens)
    kv = random_kv(layout, len(tokens), seed=10)
    markers = server.handoffs
    wait, drop = markers.wait, markers._drop
    second_in, left, go_on = threading.Event(), threading.Event(), threading.Event()
    calls = 0

    def held_wait(*args: object, **kwargs: object) -> int:
        nonlocal calls
        calls += 1
        if calls == 2:  # the second wait, its marker opened: held until the first one left
            second_in.set()
            go_on.wait(10)
        return wait(*args, **kwargs)

    def seen_drop(*args: object, **kwargs: object) -> object:
        try:
            return drop(*args, **kwargs)
        finally:
            if sys._getframe(1).f_code.co_name == "_left":
                left.set()

    markers.wait, markers._drop = held_wait, seen_drop  # type: ignore[method-assign]
    try:
        async with KVStoreClient(server.address, ns) as client:
            handoff = new_handoff_id()
            await client.handoff_open(handoff, None, ttl_s=30.0)
            first = tokens[: layout.page_tokens]
            assert await client.put(first, kv[:, :, : len(first)].contiguous()) == len(first)
            leaving = asyncio.ensure_future(client.handoff_wait(handoff, tokens, deadline_s=30.0))
            await until(lambda: calls >= 1, "the first wait did not begin")
            staying = asyncio.ensure_future(client.handoff_wait(handoff, tokens, deadline_s=10.0))
            await until(second_in.is_set, "the second wait did not open the marker")
            leaving.cancel()
            await until(left.is_set, "the cancelled wait did not leave")
            go_on.set()
            assert await client.put(tokens, kv) == len(tokens)
            assert await client.handoff_complete(handoff, tokens) == len(tokens)
            hit = await staying
            assert hit.num_tokens == len(tokens), "the second wait is handed the pages"
            out = torch.zeros_like(kv)
            assert await client.get(hit, out) == len(tokens) and torch.equal(out, kv)
            assert len(markers) == 0 and await leases(client) == 0, "its acquire lets them go: nothing is left"
    finally:
        go_on.set()
        markers.wait, markers._drop = wait, drop  # type: ignore[method-assign]


async def test_a_wait_whose_caller_left_as_its_pages_came_hands_nothing(server, ns, layout) -> None:
    """Bug: a wait looked at its caller only while nothing was there for it: one whose caller left
    as its pages came (or during a pull from the pool, which can take seconds) handed them anyway,
    pinned for nobody until the handoff's ttl (up to 600 s: a wait's deadline lengthens it). It
    looks once more as it hands them. Here the wait's thread is held from its pages' arrival until
    the cancel reached the server."""
    tokens = _tokens(11, 2, layout.page_tokens)
    kv = random_kv(layout, len(tokens), seed=11)
    markers = server.handoffs
    hand, wake = markers._hand, markers.wake
    handing, woken, go_on = threading.Event(), threading.Event(), threading.Event()

    def held_hand(*args: object, **kwargs: object) -> int:
        handing.set()
        go_on.wait(10)
        return hand(*args, **kwargs)

    def seen_wake() -> None:
        wake()
        woken.set()

    markers._hand, markers.wake = held_hand, seen_wake  # type: ignore[method-assign]
    try:
        async with KVStoreClient(server.address, ns) as client:
            handoff = new_handoff_id()
            await client.handoff_open(handoff, None, ttl_s=30.0)
            first = tokens[: layout.page_tokens]
            assert await client.put(first, kv[:, :, : len(first)].contiguous()) == len(first)
            leaving = asyncio.ensure_future(client.handoff_wait(handoff, tokens, deadline_s=30.0))
            await asyncio.sleep(0.3)
            assert await client.put(tokens, kv) == len(tokens)
            assert await client.handoff_complete(handoff, tokens) == len(tokens)
            await until(handing.is_set, "the wait did not end")
            leaving.cancel()
            await until(woken.is_set, "the cancel did not reach the server")
            go_on.set()
            await until(lambda: not server.streams.num_open, "the left wait did not end", 20)
            assert len(markers) == 0 and await leases(client) == 0, "nothing is pinned for a caller that left"
    finally:
        go_on.set()
        markers._hand, markers.wake = hand, wake  # type: ignore[method-assign]


async def test_undecodable_or_random_handoff_requests_are_clear_errors(server, ns, layout) -> None:
    """The Handoff service gets random, truncated, mutated and valid payloads (as every other
    service does in test_bad_input.py): none answers INTERNAL or UNKNOWN or hangs, an undecodable
    one is INVALID_ARGUMENT naming the method; then nothing is left and the server serves."""
    from test_bad_input import fuzz_failures

    from kvstore._proto import handoff_pb2 as handoff_proto

    _, failures = fuzz_failures(server.address, [handoff_proto], random.Random(36), 24)
    assert not failures, failures[:10]
    server.handoffs.expire()
    async with KVStoreClient(server.address, ns) as client:
        assert await leases(client) == 0
        tokens = _tokens(8, 1, layout.page_tokens)
        assert await client.put(tokens, random_kv(layout, len(tokens), seed=8)) == len(tokens)
