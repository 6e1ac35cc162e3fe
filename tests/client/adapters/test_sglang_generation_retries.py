"""The SGLang HiCache backend's writes after a write of the same keys (DESIGN §3): a retry of a
write refused as stale, and another write of KV computed on the same lookups, name the generation
the first named, so neither stores KV of an older generation in the new one, whatever generation
the connection saw since. Writes whose pages do not match their keys store nothing and answer
False. A real kvstore server on 127.0.0.1 (test_sglang_save_generation.py's backends)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from test_sglang_backend import P, host_indices, keys
from test_sglang_save_generation import invalidate, make_backend, sglang  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(60)


def exists_on_a_thread(backend: Any, k: list[str]) -> int:
    """``batch_exists`` from another thread, as SGLang's prefetch thread calls it."""
    found: list[int] = []
    thread = threading.Thread(target=lambda: found.append(backend.batch_exists(k)))
    thread.start()
    thread.join(30)
    return found[0]


def test_a_retry_of_a_refused_write_is_refused_again(make_backend: Any, server: Any) -> None:  # noqa: F811 - the fixture
    """Regression: the refusal forgot the keys, so the retry named the highest generation seen (1,
    from another key's lookup) and stored KV looked up in generation 0."""
    backend, _ = make_backend()
    k = keys(2, tag="retry")
    assert backend.batch_exists(k) == 0
    assert invalidate(server.address, backend.store.namespace) == 1
    assert backend.batch_exists(keys(1, tag="retry-other")) == 0  # the connection sees generation 1
    assert backend.batch_set_v1(k, host_indices([0, 1])) == [False, False]
    assert backend.batch_set_v1(k, host_indices([0, 1])) == [False, False]
    reader, _ = make_backend()
    assert reader.batch_exists(k) == 0, "a retried write stored KV looked up in generation 0"
    assert backend.batch_exists(k) == 0  # looked up again in generation 1: its next write is stored
    assert backend.batch_set_v1(k, host_indices([0, 1])) == [True, True]


def test_lookups_on_two_threads_then_their_writes(make_backend: Any, server: Any) -> None:  # noqa: F811 - the fixture
    """One thread looks keys up in generation 0, another in 1; the fresh write comes first and is
    refused (the keys' lowest is 0). Regression: the stale one came next, named the highest seen
    and was stored."""
    backend, _ = make_backend()
    k = keys(2, tag="threads")
    assert exists_on_a_thread(backend, k) == 0
    assert invalidate(server.address, backend.store.namespace) == 1
    assert exists_on_a_thread(backend, k) == 0
    assert backend.batch_set_v1(k, host_indices([0, 1])) == [False, False]
    assert backend.batch_set_v1(k, host_indices([2, 3])) == [False, False], "KV looked up in generation 0 stored in 1"


def test_a_second_write_of_kv_from_the_same_lookups(make_backend: Any, server: Any) -> None:  # noqa: F811 - the fixture
    """Two requests computed the same keys on lookups in generation 0; the first write is stored
    before the invalidation, the second comes after it and is refused."""
    backend, pool = make_backend()
    k = keys(2, tag="twice")
    assert backend.batch_exists(k) == 0 and backend.batch_exists(k) == 0
    assert backend.batch_set_v1(k, host_indices([0, 1])) == [True, True]
    assert invalidate(server.address, backend.store.namespace) == 1
    assert backend.batch_exists(keys(1, tag="twice-other")) == 0
    assert backend.batch_set(k, [pool.get_data_page(2 * P), pool.get_data_page(3 * P)]) is False
    reader, _ = make_backend()
    assert reader.batch_exists(k) == 0


def test_pages_that_do_not_match_their_keys_store_nothing(make_backend: Any) -> None:  # noqa: F811 - the fixture
    """Regression: fewer pages than keys (or host indices for fewer pages) raised IndexError out of
    the backend, a page of the wrong size RuntimeError."""
    backend, pool = make_backend()
    k = keys(3, tag="short")
    assert backend.batch_set(k, []) is False
    assert backend.batch_set(k, [pool.get_data_page(0)]) is False
    assert backend.batch_set(k[:1], [pool.get_data_page(0), pool.get_data_page(P)]) is False
    assert backend.batch_set(k[:1], [pool.get_data_page(0)[:-1]]) is False  # not a page
    assert backend.batch_set_v1(k, host_indices([0])) == [False] * 3
    assert backend.batch_exists(k) == 0
