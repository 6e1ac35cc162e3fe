"""A hybrid decode's background receive (hybrid_handoff.py, DESIGN §12.7) stages only the pages it
writes, and a staging allocation that fails (vLLM's KV device full) fails that request alone, the
store's connection kept: a real kvstore-server process, the connector's sides driven in vLLM's
order, as test_vllm_pd_hybrid_parts.py does. Written by an adversarial review; each failed on 95563ed."""

from __future__ import annotations

import random
import time

import pytest
import test_vllm_hybrid_load_costs as hybrid
import torch
from support.servers import ServerProcess
from test_vllm_pd_hybrid_parts import NAMESPACE, TABLES, decode_worker, engine_step

from kvstore.client.adapters.vllm.metadata import GroupLoad, KVStoreConnectorMetadata
from kvstore.client.client import KVStoreClient
from kvstore.client.handoff import new_handoff_id

BLOCK, PAGES = hybrid.BLOCK, hybrid.PAGES


def handed_off(address: str, tokens: list[int], handoff_id: str | None = None) -> str:
    """The prefill side at the one node (test_vllm_pd_hybrid_parts.handed_off, with the id given)."""
    import asyncio

    kv = torch.randn(hybrid.LAYOUT.num_layers, 2, len(tokens), hybrid.HEADS, hybrid.DIM)
    ident = handoff_id or new_handoff_id()

    async def run() -> str:
        async with KVStoreClient(address, NAMESPACE) as client:
            assert await client.put(tokens, kv) == len(tokens)
            assert await client.handoff_complete(ident, tokens, "nd") == len(tokens)
            return ident
    return asyncio.run(run())


@pytest.fixture
def store(server_process: ServerProcess) -> ServerProcess:
    server_process.start()
    return server_process


def _land(connector: object, load: GroupLoad, what: str, start: bool = True) -> tuple[set[str], set[str]]:
    """Steps until the load's request is reported (finished or failed receiving); ``start``:
    the first step carries the load (else it was started before)."""
    metas = [KVStoreConnectorMetadata(group_loads=[load], num_scheduled_tokens=5)] if start else []
    deadline, done, failed = time.monotonic() + 20, set(), set()
    while load.req_id not in done:
        assert time.monotonic() < deadline, f"{what}: never reported"
        d, f, _ = engine_step(connector, metas.pop() if metas else KVStoreConnectorMetadata(num_scheduled_tokens=5))  # type: ignore[arg-type]
        done, failed = done | d, failed | f
        time.sleep(0.02)
    return done, failed


def test_a_staging_allocation_that_fails_does_not_drop_the_store_connection(store: ServerProcess) -> None:
    """The staging tensor of a hybrid receive is allocated on vLLM's KV device, in the
    background, for every page of the handoff (GroupedBlocks.staging). When that allocation
    fails (torch.OutOfMemoryError on a GPU busy with vLLM's forward pass), HybridReceives._ended
    hands the exception to StoreConnection.failed, which takes anything that is not a
    KVStoreError for a transport failure: the engine's one store connection is dropped and
    closed, and with it every other receive, save and handoff completion in flight on it."""
    tokens = [random.Random(21).randrange(1, 50_000) for _ in range(PAGES * BLOCK)]
    other = [random.Random(23).randrange(1, 50_000) for _ in range(PAGES * BLOCK)]
    handoff_id = handed_off(store.address, tokens)
    conn, connector = decode_worker(store.address)
    try:
        before = conn.client()
        assert before is not None
        make, calls = connector.worker.receives.staging, []  # type: ignore[union-attr]

        def no_memory_once(n: int) -> torch.Tensor:
            calls.append(n)
            if len(calls) == 1:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} pages")
            return make(n)

        connector.worker.receives.staging = no_memory_once  # type: ignore[union-attr]
        # another decode "e" waits for its handoff meanwhile (its prefill completes later)
        later = new_handoff_id()
        waiting = GroupLoad("e", other, TABLES, 0, PAGES, handoff_id=later, handoff_wait_s=15.0)
        engine_step(connector, KVStoreConnectorMetadata(group_loads=[waiting], num_scheduled_tokens=5))  # type: ignore[arg-type]
        load = GroupLoad("d", tokens, TABLES, 0, PAGES, handoff_id=handoff_id, handoff_wait_s=10.0)
        _, failed = _land(connector, load, "the receive whose staging could not be allocated")
        assert "d" in failed, "precondition: the load failed (it recomputes)"
        handed_off(store.address, other, later)  # e's prefill completes now
        _, failed = _land(connector, GroupLoad("e", other, TABLES, 0, PAGES), "e", start=False)
        assert conn.client() is before and "e" not in failed, (
            "a local allocation failure of one receive dropped the engine's store connection (StoreConnection.failed "
            f"took torch.OutOfMemoryError for a transport failure), and the other decode's receive failed with it: "
            f"e failed={'e' in failed}, connection kept={conn.client() is before}")
    finally:
        connector.worker.shutdown()  # type: ignore[union-attr]
        conn.close()


def test_a_receive_stages_only_the_pages_it_writes(store: ServerProcess) -> None:
    """A decode whose first pages vLLM's own prefix cache holds (GroupLoad.first_page > 0)
    writes only ``num_pages`` pages, yet HybridReceives._receive allocates its staging tensor
    on vLLM's KV device for every page of the prompt (n = first_page + num_pages) and holds it
    until the write between steps: device memory outside vLLM's KV budget, in proportion to the
    whole prompt, once per receive in flight (nothing bounds how many). The pages before
    ``first_page`` are got only so that the marker is let go (an Acquire and Release of them
    would do that)."""
    tokens = [random.Random(22).randrange(1, 50_000) for _ in range(PAGES * BLOCK)]
    handoff_id = handed_off(store.address, tokens)
    conn, connector = decode_worker(store.address)
    side = connector.worker
    asked: list[int] = []
    make = side.receives.staging  # type: ignore[union-attr]

    def recorded(n: int) -> torch.Tensor:
        asked.append(n)
        return make(n)

    side.receives.staging = recorded  # type: ignore[union-attr]
    try:
        first, num = PAGES - 1, 1  # vLLM's own cache holds all but the last page
        load = GroupLoad("d", tokens, TABLES, first, num, handoff_id=handoff_id, handoff_wait_s=10.0)
        done, failed = _land(connector, load, "the receive")
        assert "d" in done and "d" not in failed, "precondition: the load landed"
        assert asked and max(asked) <= num, (f"a load of {num} page staged {max(asked)} pages of every layer on vLLM's KV "
                                             "device (the whole prompt)")
    finally:
        side.shutdown()  # type: ignore[union-attr]
        conn.close()
