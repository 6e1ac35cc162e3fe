"""The SGLang HiCache backend's writes name the namespace generation its lookup of those keys
answered (DESIGN §3): a write-back of KV that SGLang computed on, or loaded by, a lookup made
before an acknowledged invalidation is refused (a False for those keys), never stored in the
new generation. A real kvstore server on 127.0.0.1; the backend driven as SGLang's cache
controller drives it (test_sglang_backend.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from sglang_api import HostPool
from test_sglang_backend import P, host_indices, keys, sglang, storage_config  # noqa: F401  # sglang: the fixture

from kvstore import Namespace
from kvstore.client import KVStoreClient

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def make_backend(sglang: Any, server: Any) -> Iterator[Any]:  # noqa: F811  # sglang: the imported fixture
    from kvstore.client.adapters.sglang import KVStoreHiCacheStorage

    made: list[Any] = []

    def make() -> tuple[Any, HostPool]:
        backend = KVStoreHiCacheStorage(storage_config(sglang, server.address, "page_first"), {})
        pool = HostPool("page_first", page_size=P)
        pool.fill(seed=len(made) + 1)
        backend.register_mem_pool_host(pool)
        made.append(backend)
        return backend, pool

    yield make
    for backend in made:
        backend.close()


def invalidate(address: str, namespace: Namespace) -> int:
    """An acknowledged invalidation, from another client (the operator's); the new generation."""
    async def go() -> int:
        async with KVStoreClient(address, namespace) as client:
            return await client.invalidate()
    return asyncio.run(go())


@pytest.mark.parametrize("hit", [False, True], ids=["miss", "hit"])
@pytest.mark.parametrize("api", ["v1", "tensor"])
def test_a_write_back_of_kv_looked_up_before_an_invalidation_is_refused(make_backend: Any, server: Any,
                                                                       hit: bool, api: str) -> None:
    """Regression: the backend named no generation, so these write-backs were stored in generation 1
    (``batch_set_v1`` answered True and a later ``batch_exists`` found the pages)."""
    k = keys(4, tag=f"stale-{api}-{hit}")
    if hit:
        writer, _ = make_backend()
        assert writer.batch_set_v1(k, host_indices([0, 1, 2, 3])) == [True] * 4
    backend, pool = make_backend()
    assert backend.batch_exists(k) == (4 if hit else 0)  # generation 0
    if hit:  # SGLang loads what the lookup found into its host pool
        assert backend.batch_get_v1(k, host_indices([4, 5, 6, 7])) == [True] * 4
    assert invalidate(server.address, backend.store.namespace) == 1
    pages = [4, 5, 6, 7] if hit else [0, 1, 2, 3]
    if api == "v1":
        assert backend.batch_set_v1(k, host_indices(pages)) == [False] * 4
    else:
        assert backend.batch_set(k, [pool.get_data_page(i * P) for i in pages]) is False
    reader, _ = make_backend()
    assert reader.batch_exists(k) == 0, "KV looked up in generation 0 was stored in generation 1"


def test_a_write_back_looked_up_in_the_current_generation_is_stored(make_backend: Any, server: Any) -> None:
    backend, _ = make_backend()
    assert invalidate(server.address, backend.store.namespace) == 1
    k = keys(3, tag="current")
    assert backend.batch_exists(k) == 0
    assert backend.batch_set_v1(k, host_indices([0, 1, 2])) == [True] * 3
    one = keys(1, tag="one")[0]
    assert backend.exists(one) is False  # one key: ``set`` after ``exists`` names the same generation
    assert backend.set(one, backend.pool.get_data_page(3 * P)) is True


def test_a_write_never_looked_up_names_the_highest_generation_seen(make_backend: Any, server: Any) -> None:
    """Keys SGLang computed without asking the store (its own radix cache's prefix) name the highest
    generation the connection saw: 0 (learned at connect) until a lookup answers 1."""
    backend, pool = make_backend()
    assert invalidate(server.address, backend.store.namespace) == 1
    k = keys(2, tag="unasked")
    assert backend.batch_set_v1(k, host_indices([0, 1])) == [False, False]
    assert backend.batch_exists(keys(1, tag="other")) == 0  # answers generation 1
    assert backend.batch_set(k, [pool.get_data_page(0), pool.get_data_page(P)]) is True
    assert backend.batch_exists(k) == 2


def test_a_refused_keys_next_lookup_counts(make_backend: Any, server: Any) -> None:
    """A refused key's next lookup (generation 1) replaces what it remembered: its next write is
    stored (a write without a lookup first names the refused generation again:
    test_sglang_generation_retries.py)."""
    backend, _ = make_backend()
    k = keys(2, tag="again")
    assert backend.batch_exists(k) == 0
    assert invalidate(server.address, backend.store.namespace) == 1
    assert backend.batch_set_v1(k, host_indices([0, 1])) == [False, False]
    assert backend.batch_exists(k) == 0
    assert backend.batch_set_v1(k, host_indices([0, 1])) == [True, True]


def test_a_batch_stores_its_current_keys_up_to_the_first_stale_one(make_backend: Any, server: Any) -> None:
    """Keys of one write looked up in two generations: those of the current one that lead are
    stored, the stale ones (and any after them: only a contiguous prefix counts) are not."""
    backend, _ = make_backend()
    old = keys(2, tag="old")
    assert backend.batch_exists(old) == 0
    assert invalidate(server.address, backend.store.namespace) == 1
    new = keys(2, tag="new")
    assert backend.batch_exists(new) == 0
    assert backend.batch_set_v1(new + old, host_indices([0, 1, 2, 3])) == [True, True, False, False]
    assert backend.batch_exists(new) == 2 and backend.batch_exists(old) == 0


def test_remembered_generations_are_bounded() -> None:
    from kvstore.client.adapters.lookup_generations import LookupGenerations

    remembered = LookupGenerations(capacity=4)
    remembered.remember([bytes([i]) * 16 for i in range(10)], 3)
    assert len(remembered) == 4
    assert remembered.take([bytes([0]) * 16, bytes([9]) * 16]) == [None, 3]  # the oldest were forgotten
    remembered.remember([bytes([8]) * 16], 5)  # a later lookup never raises what an earlier one answered
    remembered.remember([bytes([7]) * 16], 1)
    assert remembered.take([bytes([8]) * 16, bytes([7]) * 16]) == [3, 1]
    assert remembered.take([bytes([8]) * 16]) == [3] and len(remembered) == 4  # a write keeps what it named
    remembered.remember([bytes([8]) * 16], 5)  # until the key's next lookup
    assert remembered.take([bytes([8]) * 16]) == [5]
