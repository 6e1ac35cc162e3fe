"""The ``transformers`` helper's saves name the namespace generation its restore of those tokens
answered (DESIGN §3): a cache computed on a restore made before an acknowledged invalidation is
not stored in the new generation (``save`` returns 0). A real kvstore server on 127.0.0.1."""

from __future__ import annotations

import pytest
import torch
from support.kv import SMALL

from kvstore import Namespace
from kvstore.client import KVStoreClient
from kvstore.client.adapters.hf import HFKVCache, cache_from_layers

pytestmark = pytest.mark.timeout(60)
P = SMALL.page_tokens


def prompt(seed: int, pages: int = 3) -> list[int]:
    """``pages`` full pages and one token: a restore looks up the pages, a save stores them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5000, (pages * P + 1,), generator=g).tolist()


def computed(tokens: int, seed: int) -> object:
    """A DynamicCache of ``tokens`` tokens, as the model would have computed it."""
    g = torch.Generator().manual_seed(seed)
    shape = (1, SMALL.num_kv_heads, tokens, SMALL.head_dim)
    layers = [[torch.randn(shape, generator=g).to(SMALL.dtype) for _ in range(SMALL.num_layers)] for _ in range(2)]
    return cache_from_layers(layers[0], layers[1])


async def stored_pages(client: KVStoreClient, ids: list[int]) -> int:
    return (await client.lookup(ids)).num_pages


@pytest.mark.parametrize("hit", [False, True], ids=["miss", "hit"])
async def test_a_save_computed_on_a_restore_before_an_invalidation_is_not_stored(server: object, ns: Namespace,
                                                                                 hit: bool) -> None:
    """Regression: the helper's save named no generation, so it returned 48 and a later lookup
    found the pages in generation 1."""
    ids = prompt(seed=1)
    async with KVStoreClient(server.address, ns) as client, KVStoreClient(server.address, ns) as operator:  # type: ignore[attr-defined]
        cache = HFKVCache(client)
        if hit:
            assert await HFKVCache(operator).save(ids, computed(len(ids), seed=2)) == 3 * P
        n, _ = await cache.restore(ids)
        assert n == (3 * P if hit else 0)
        assert await operator.invalidate() == 1
        assert await cache.save(ids, computed(len(ids), seed=3)) == 0
        assert await stored_pages(operator, ids) == 0, "KV restored in generation 0 was stored in generation 1"


async def test_a_save_after_a_restore_in_the_current_generation_is_stored(server: object, ns: Namespace) -> None:
    ids = prompt(seed=4)
    async with KVStoreClient(server.address, ns) as client:  # type: ignore[attr-defined]
        cache = HFKVCache(client)
        assert await client.invalidate() == 1
        assert (await cache.restore(ids))[0] == 0
        assert await cache.save(ids, computed(len(ids), seed=5)) == 3 * P
        assert await stored_pages(client, ids) == 3


async def test_a_save_never_restored_names_the_highest_generation_seen(server: object, ns: Namespace) -> None:
    """A save with no restore of its tokens names the highest generation the client saw; an explicit
    ``generation`` (a Hit's) wins over both."""
    ids, other = prompt(seed=6), prompt(seed=7)
    async with KVStoreClient(server.address, ns) as client, KVStoreClient(server.address, ns) as operator:  # type: ignore[attr-defined]
        cache = HFKVCache(client)
        assert (await cache.restore(other))[0] == 0  # generation 0 seen
        assert await operator.invalidate() == 1
        assert await cache.save(ids, computed(len(ids), seed=8)) == 0
        assert await cache.save(ids, computed(len(ids), seed=8), generation=1) == 3 * P
        assert await cache.save(other, computed(len(other), seed=9)) == 0  # its restore's generation: 0


async def test_a_later_turn_restored_after_the_invalidation_is_stored(server: object, ns: Namespace) -> None:
    """A chat's next turn: its prompt holds the last turn's, restored again after the invalidation;
    its save is stored (the restore replaces what the refused save kept)."""
    first = prompt(seed=10)
    async with KVStoreClient(server.address, ns) as client, KVStoreClient(server.address, ns) as operator:  # type: ignore[attr-defined]
        cache = HFKVCache(client)
        assert (await cache.restore(first))[0] == 0
        assert await operator.invalidate() == 1
        assert await cache.save(first, computed(len(first), seed=11)) == 0
        second = first + prompt(seed=12, pages=1)
        assert (await cache.restore(second))[0] == 0
        assert await cache.save(second, computed(len(second), seed=13)) == 4 * P


async def test_a_save_again_without_a_restore_names_what_the_last_save_named(server: object, ns: Namespace) -> None:
    """Regression: a refused save forgot its pages, so saving the same cache again, once another
    restore had shown the client generation 1, stored KV restored in generation 0."""
    ids, other = prompt(seed=14), prompt(seed=15)
    async with KVStoreClient(server.address, ns) as client, KVStoreClient(server.address, ns) as operator:  # type: ignore[attr-defined]
        cache, past = HFKVCache(client), computed(len(ids), seed=16)
        assert (await cache.restore(ids))[0] == 0
        assert await operator.invalidate() == 1
        assert (await cache.restore(other))[0] == 0  # generation 1 seen
        assert await cache.save(ids, past) == 0
        assert await cache.save(ids, past) == 0
        assert await stored_pages(operator, ids) == 0, "KV restored in generation 0 was stored in generation 1"
