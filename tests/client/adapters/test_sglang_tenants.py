"""The SGLang HiCache backend on a real kvstore-server with --auth-file and two tenants: its
token options, and page keys that are each tenant's own (SGLang does not run on CPU: the
backend class is driven as SGLang's cache controller drives it, as in test_sglang_backend.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_api import HostPool
from support.servers import ServerProcess
from tenant_store import TOKEN_A, TOKEN_B, TOKEN_UNKNOWN, num_leases, stop, tenant_server
from test_sglang_backend import P, host_indices, keys, sglang, storage_config  # noqa: F401  # sglang: the fixture

from kvstore.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = tenant_server(tmp_path)
    yield proc
    stop(proc)


@pytest.fixture
def make_backend(sglang: Any, server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:  # noqa: F811
    from kvstore.client.adapters.sglang import KVStoreHiCacheStorage

    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_TOKEN_FILE", raising=False)
    made: list[Any] = []

    def make(**extra: Any) -> tuple[Any, HostPool]:
        config = storage_config(sglang, server.address, "page_first")
        config.extra_config.update(extra)
        backend = KVStoreHiCacheStorage(config, {})
        made.append(backend)
        pool = HostPool("page_first", page_size=P)
        backend.register_mem_pool_host(pool)
        return backend, pool

    yield make
    for backend in made:
        backend.close()


def test_two_tenants_configured_alike_get_their_own_page_keys(make_backend: Any, server: ServerProcess, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: page keys were hashed from the configured (unsalted) namespace id, so two tenants
    configured alike computed the same keys: Allocate answering "exists" by key told one what the
    other had cached, and the second one's pages were never stored. Now each tenant's keys come
    from its salted namespace: the same SGLang keys are other kvstore keys for each tenant."""
    token_file = tmp_path / "token-b"
    token_file.write_text(TOKEN_B)
    monkeypatch.setenv("KVSTORE_TOKEN_FILE", str(token_file))  # b's token from the environment, a's from its option
    a, pool_a = make_backend(token=TOKEN_A)
    b, pool_b = make_backend()
    pool_a.fill(seed=1)
    pool_b.fill(seed=2)
    k = keys(3, tag="same")
    assert a.batch_set_v1(k, host_indices([0, 1, 2])) == [True] * 3
    assert b.batch_exists(k) == 0, "b sees a's pages"
    kv_a, kv_b = a._keys(a.store.client(), k), b._keys(b.store.client(), k)
    assert set(kv_a).isdisjoint(kv_b), "both tenants computed the same page keys"
    assert b.batch_set_v1(k, host_indices([0, 1, 2])) == [True] * 3
    for backend, want in ((a, pool_a), (b, pool_b)):
        dst = HostPool("page_first", page_size=P)
        backend.pool = dst
        assert backend.batch_get_v1(k, host_indices([4, 5, 6])) == [True] * 3
        assert all(torch.equal(dst.canonical((4 + i) * P), want.canonical(i * P)) for i in range(3))
    assert num_leases(server.address) == 0


def test_a_refused_token_fails_at_registration_naming_the_option(make_backend: Any) -> None:
    with pytest.raises(ConfigError, match='unknown token.*hicache-storage-backend-extra-config "token"'):
        make_backend(token=TOKEN_UNKNOWN)
    with pytest.raises(ConfigError, match='no credential.*give a token with --hicache-storage-backend-extra-config "token"'):
        make_backend()
