"""A handoff taken over (its reader acquired every page its wait was handed, DESIGN §12.7) while a
second wait of it comes in: the second wait is still handed the pages, pinned until its own read.

Found by a review of 2dccfc3: the acquire decided under the markers' lock that nobody read the
marker any more, then dropped it with its pins after letting the lock go; a wait that opened the
marker in between answered nothing (its pages held here) or was handed pages whose pins went
under it. The decision is made again where the marker is dropped. Here the acquire's thread is
held between the two (as the scheduler may hold it)."""

from __future__ import annotations

import asyncio
import sys
import threading

import torch
from support.handoffs import leases, until
from support.kv import random_kv

from kvstore.client import KVStoreClient, new_handoff_id


async def test_a_wait_that_comes_as_the_handoff_is_taken_over_is_still_handed_its_pages(server, ns, layout) -> None:
    tokens = list(range(1, 2 * layout.page_tokens + 1))
    kv = random_kv(layout, len(tokens), seed=12)
    markers = server.handoffs
    drop, opened = markers._drop, markers.open
    dropping, second_in, go_on = threading.Event(), threading.Event(), threading.Event()

    def held_drop(*args: object, **kwargs: object) -> object:
        if sys._getframe(1).f_code.co_name == "acquired":  # the take-over's drop: held until the second wait is in
            dropping.set()
            go_on.wait(10)
        return drop(*args, **kwargs)

    def seen_open(*args: object, **kwargs: object) -> object:
        try:
            return opened(*args, **kwargs)
        finally:
            if kwargs.get("waiter") and dropping.is_set():
                second_in.set()

    markers._drop, markers.open = held_drop, seen_open  # type: ignore[method-assign]
    try:
        async with KVStoreClient(server.address, ns) as client:
            handoff = new_handoff_id()
            assert await client.put(tokens, kv) == len(tokens)
            assert await client.handoff_complete(handoff, tokens) == len(tokens)
            first = await client.handoff_wait(handoff, tokens, deadline_s=5.0)
            assert first.num_tokens == len(tokens)
            reading = asyncio.ensure_future(client.get(first, torch.zeros_like(kv)))  # its acquire takes the handoff over
            await until(dropping.is_set, "the read did not take the handoff over")
            second = asyncio.ensure_future(client.handoff_wait(handoff, tokens, deadline_s=5.0))
            await until(second_in.is_set, "the second wait did not open the marker")
            await asyncio.sleep(0.2)  # it may be handed its pages meanwhile, or not yet
            go_on.set()
            assert await reading == len(tokens)
            hit = await second
            assert hit.num_tokens == len(tokens), "the second wait answered nothing, its pages held here"
            assert len(markers) == 1 and await leases(client) == 1, "the pages handed to the second wait stay pinned"
            out = torch.zeros_like(kv)
            assert await client.get(hit, out) == len(tokens) and torch.equal(out, kv)
            assert len(markers) == 0 and await leases(client) == 0, "its read lets them go: nothing is left"
    finally:
        go_on.set()
        markers._drop, markers.open = drop, opened  # type: ignore[method-assign]
