"""The SGLang HiCache backend against SGLang's real abstract class (from the
sglang==0.5.23 wheel) and a real kvstore server: every method, each host pool layout."""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sglang_api import HostPool, load_sglang_interface
from support.servers import flip_arena_byte

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
P = 8


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Any:
    load_sglang_interface(tmp_path_factory.mktemp("sglang-api"))
    from sglang.srt.mem_cache import hicache_storage

    return hicache_storage


def storage_config(sglang: Any, address: str, layout: str) -> Any:
    return sglang.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=layout != "layer_first", model_name="tiny/model",
        extra_config={"address": address, "backend_name": "kvstore", "module_path": "kvstore.client.adapters.sglang",
                      "class_name": "KVStoreHiCacheStorage"})


@pytest.fixture
def make_backend(sglang: Any, server: Any) -> Iterator[Any]:
    from kvstore.client.adapters.sglang import KVStoreHiCacheStorage

    made: list[Any] = []

    def make(layout: str, address: str | None = None) -> tuple[Any, HostPool]:
        backend = KVStoreHiCacheStorage(storage_config(sglang, address or server.address, layout), {})
        pool = HostPool(layout, page_size=P)
        backend.register_mem_pool_host(pool)
        made.append(backend)
        return backend, pool

    yield make
    for backend in made:
        backend.close()


def keys(n: int, tag: str = "k") -> list[str]:
    return [f"{tag}{i:04d}" + "ab" * 30 for i in range(n)]


def host_indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * P + t for p in pages for t in range(P)], dtype=torch.int64)


def test_implements_sglangs_abstract_class(sglang: Any) -> None:
    from kvstore.client.adapters.sglang import KVStoreHiCacheStorage

    assert issubclass(KVStoreHiCacheStorage, sglang.HiCacheStorage)
    assert not inspect.isabstract(KVStoreHiCacheStorage)
    for name in ("get", "batch_get", "set", "batch_set", "exists", "batch_exists", "batch_get_v1", "batch_set_v1"):
        assert getattr(KVStoreHiCacheStorage, name) is not getattr(sglang.HiCacheStorage, name), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_copy_round_trip(make_backend: Any, layout: str) -> None:
    """batch_set_v1 from host pages, batch_exists counts them, batch_get_v1 puts the same
    bytes into other pages of another pool."""
    src_backend, src = make_backend(layout)
    src.fill(seed=1)
    k = keys(4, tag=layout)
    assert src_backend.batch_set_v1(k, host_indices([3, 0, 5, 1])) == [True] * 4
    dst_backend, dst = make_backend(layout)
    assert dst_backend.batch_exists(k) == 4
    assert dst_backend.exists(k[2]) is True
    assert dst_backend.batch_get_v1(k, host_indices([7, 8, 9, 10])) == [True] * 4
    for got, want in zip([7, 8, 9, 10], [3, 0, 5, 1]):
        assert torch.equal(dst.canonical(got * P), src.canonical(want * P))


def test_pages_are_shared_across_host_layouts(make_backend: Any) -> None:
    """Pages are stored in kvstore's canonical layout: a page_first pool reads what a
    layer_first pool wrote."""
    writer, src = make_backend("layer_first")
    src.fill(seed=2)
    k = keys(2, tag="x")
    assert writer.batch_set_v1(k, host_indices([1, 2])) == [True, True]
    reader, dst = make_backend("page_first")
    assert reader.batch_get_v1(k, host_indices([4, 5])) == [True, True]
    assert torch.equal(dst.canonical(4 * P), src.canonical(1 * P))
    assert torch.equal(dst.canonical(5 * P), src.canonical(2 * P))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tensor_api_round_trip(make_backend: Any, layout: str) -> None:
    """get/set/batch_get/batch_set with flat pages in the host pool's order."""
    backend, pool = make_backend(layout)
    pool.fill(seed=3)
    k = keys(3, tag="t" + layout)
    assert backend.set(k[0], pool.get_data_page(2 * P)) is True
    assert backend.batch_set(k[1:], [pool.get_data_page(4 * P), pool.get_data_page(6 * P)]) is True
    target = pool.get_dummy_flat_data_page()
    got = backend.get(k[0], target)
    assert got is target and torch.equal(target, pool.get_data_page(2 * P))
    got_all = backend.batch_get(k)
    assert [torch.equal(g, pool.get_data_page(i * P)) for g, i in zip(got_all, [2, 4, 6])] == [True] * 3
    assert backend.get(keys(1, tag="never")[0]) is None
    # a set without its page (SGLang's zero-copy call shape, which this backend does not take) stores nothing
    assert backend.set(keys(1, tag="none")[0]) is False and backend.batch_set(keys(2, tag="none"), [None, None]) is False
    assert backend.batch_exists(keys(2, tag="none")) == 0


def test_batch_exists_counts_leading_hits_only(make_backend: Any) -> None:
    backend, pool = make_backend("layer_first")
    pool.fill(seed=4)
    k = keys(4, tag="gap")
    assert backend.batch_set_v1([k[0], k[1], k[3]], host_indices([0, 1, 3])) == [True] * 3
    assert backend.batch_exists(k) == 2
    assert backend.exists(k[2]) is False
    assert backend.batch_exists([]) == 0
    dst = HostPool("layer_first", page_size=P)
    backend.pool = dst  # read into a fresh pool: untouched pages stay zero
    assert backend.batch_get_v1(k, host_indices([8, 9, 10, 11])) == [True, True, False, False]
    assert torch.count_nonzero(dst.canonical(10 * P)) == 0 and torch.count_nonzero(dst.canonical(11 * P)) == 0


def test_corrupt_page_is_a_miss_and_never_reaches_the_pool(make_backend: Any, server: Any) -> None:
    backend, pool = make_backend("page_first")
    pool.fill(seed=5)
    k = keys(3, tag="bad")
    assert backend.batch_set_v1(k, host_indices([0, 1, 2])) == [True] * 3
    victim = backend._keys(backend.store.client(), k)[1]
    flip_arena_byte(server, server.core.where(victim)["host"] + 77)
    dst = HostPool("page_first", page_size=P)
    backend.pool = dst
    assert backend.batch_get_v1(k, host_indices([4, 5, 6])) == [True, False, False]
    assert torch.equal(dst.canonical(4 * P), pool.canonical(0))
    assert torch.count_nonzero(dst.canonical(5 * P)) == 0


def test_unreachable_store_is_a_miss_not_an_error(make_backend: Any, server: Any) -> None:
    """With the store gone every call answers at once: no hit, nothing stored."""
    backend, pool = make_backend("layer_first")
    pool.fill(seed=6)
    k = keys(2, tag="gone")
    server.stop(grace_s=0)
    start = time.monotonic()
    assert backend.batch_set_v1(k, host_indices([0, 1])) == [False, False]
    assert backend.batch_exists(k) == 0
    assert backend.batch_get_v1(k, host_indices([2, 3])) == [False, False]
    assert backend.get(k[0]) is None and backend.set(k[0], pool.get_data_page(0)) is False
    assert time.monotonic() - start < 5


def test_bad_config_is_a_clear_error(sglang: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTORE_ADDRESS", raising=False)
    from kvstore.client.adapters.sglang import KVStoreHiCacheStorage
    from kvstore.errors import ConfigError

    config = storage_config(sglang, "", "layer_first")
    config.extra_config = {}
    with pytest.raises(ConfigError, match="address"):
        KVStoreHiCacheStorage(config, {})
    mla = storage_config(sglang, "127.0.0.1:1", "layer_first")
    mla.is_mla_model = True
    with pytest.raises(ConfigError, match="MLA"):
        KVStoreHiCacheStorage(mla, {})
