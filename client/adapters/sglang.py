"""SGLang HiCache storage backend (L3) backed by kvstore.

More: client/adapters/README.md (### sglang.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.lookup_generations import LookupGenerations
from kvstore.client.client import Hit, KVStoreClient
from kvstore.errors import ConfigError, KVStoreError, PageCorrupt, PageMissing, StaleGeneration
from kvstore.security.credentials import ClientSecurity
from kvstore.types import KVLayout, Namespace

logger = logging.getLogger(__name__)

ADDRESS_ENV = "KVSTORE_ADDRESS"
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def canonical_page(pool: Any, index: int) -> torch.Tensor:
    """The host pool's page at token ``index`` as ``[layers, 2, page, heads, dim]`` (a view)."""
    page = pool.get_data_page(index, flat=False)
    return from_pool_order(page, pool.layout)


def from_pool_order(page: torch.Tensor, layout: str) -> torch.Tensor:
    """A page shaped as ``get_data_page(flat=False)`` returns it, as ``[L, 2, P, H, D]``."""
    if layout == "layer_first":  # [2, L, P, H, D]
        return page.transpose(0, 1)
    if layout == "page_first":  # [2, P, L, H, D]
        return page.permute(2, 0, 1, 3, 4)
    return page[:, 0].transpose(0, 1)  # page_first_direct: [2, 1, L, P, H, D]


def to_pool_flat(page: torch.Tensor, layout: str) -> torch.Tensor:
    """A canonical ``[L, 2, P, H, D]`` page as the flat tensor ``set_from_flat_data_page``
    takes for ``layout``."""
    if layout == "page_first":
        return page.permute(1, 2, 0, 3, 4).contiguous().flatten()
    return page.transpose(0, 1).contiguous().flatten()  # layer_first and page_first_direct: [2, L, P, H, D]


def extra_option(name: str) -> str:
    """How an error names key ``name`` of the backend's config."""
    return f'--hicache-storage-backend-extra-config "{name}"'


class KVStoreHiCacheStorage(HiCacheStorage):
    """See the module docstring. ``extra_config`` keys: ``address`` (default
    ``$KVSTORE_ADDRESS``), ``revision``, ``tenant_salt`` (a server without tenants; a tenant's
    salt comes from the server), ``timeout_s``, and as the vLLM connector's: ``token``,
    ``token_file`` (default ``$KVSTORE_TOKEN``, then ``$KVSTORE_TOKEN_FILE``), ``tls_ca``,
    ``tls_cert``, ``tls_key``, ``tls_server_name``."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.credentials = ClientSecurity.pop_from(extra).resolve(extra_option, os.environ)
        self.address = extra.get("address") or os.environ.get(ADDRESS_ENV, "")
        if not self.address:
            raise ConfigError(f'the kvstore HiCache backend needs "address" in its extra config (or {ADDRESS_ENV})')
        if storage_config.is_mla_model:
            raise ConfigError("the kvstore HiCache backend does not support MLA models yet")
        self.config = storage_config
        self.revision = str(extra.get("revision", ""))
        self.tenant_salt = str(extra.get("tenant_salt", ""))
        self.timeout_s = float(extra.get("timeout_s", 5.0))
        self.store: StoreConnection | None = None
        self.pool: Any = None
        self.generations = LookupGenerations()  # what each key's lookup answered, for its write (DESIGN §3)

    # -- setup ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host pool before any I/O; the namespace (and so the
        connection) follows from the pool's shape."""
        super().register_mem_pool_host(mem_pool_host)
        if mem_pool_host.layout not in LAYOUTS:
            raise ConfigError(f"host pool layout {mem_pool_host.layout!r} is not supported; use one of {LAYOUTS}")
        layout = KVLayout(num_layers=mem_pool_host.layer_num, num_kv_heads=mem_pool_host.head_num,
                          head_dim=mem_pool_host.head_dim, dtype=mem_pool_host.dtype, page_tokens=mem_pool_host.page_size)
        namespace = Namespace(model=self.config.model_name or "", revision=self.revision, layout=layout,
                              tp_rank=self.config.tp_rank, tp_size=self.config.tp_size, tenant_salt=self.tenant_salt)
        if self.store is not None:
            self.store.close()
        self.pool = mem_pool_host
        self.generations.clear()
        self.store = StoreConnection(self.address, namespace, credentials=self.credentials)
        self.store.start()  # raises ConfigError when the server refuses the credentials

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def _keys(self, client: KVStoreClient, keys: list[str]) -> list[bytes]:
        """kvstore's keys of SGLang's: hashed with the connected client's namespace id, which
        holds the tenant's salt, so that tenants configured alike never compute each other's keys."""
        ns = client.namespace.namespace_id
        return [hashlib.blake2b(ns + key.encode(), digest_size=16, person=b"kvstore-sglang").digest() for key in keys]

    def _layout(self) -> KVLayout:
        assert self.store is not None
        return self.store.namespace.layout

    # -- reads ---------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The number of leading keys stored (one lookup). The generation it answered is kept for
        every key: SGLang loads the stored ones and computes the rest on them, and writes both back."""
        client = self.store.client() if self.store is not None else None
        if client is None or not keys:
            return 0
        kv_keys = self._keys(client, keys)
        try:
            found, generation = self.store.stored_prefix(client, kv_keys, self.timeout_s)  # type: ignore[union-attr]
        except (KVStoreError, TimeoutError) as exc:
            self.store.failed(client, exc)  # type: ignore[union-attr]
            return 0
        self.generations.remember(kv_keys, generation)
        return found

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _read(self, keys: list[str]) -> torch.Tensor | None:
        """The leading stored, verified pages of ``keys`` as ``[L, 2, n*P, H, D]`` (None: none)."""
        client = self.store.client() if self.store is not None else None
        if client is None or not keys:
            return None
        layout = self._layout()
        kv_keys = self._keys(client, keys)
        seen = self.store.generation_seen()  # type: ignore[union-attr]
        if seen is not None:  # at most the generation of the pages read (none older is served)
            self.generations.remember(kv_keys, seen)
        kv = torch.empty((layout.num_layers, 2, len(keys) * layout.page_tokens, layout.num_kv_heads, layout.head_dim),
                         dtype=layout.torch_dtype())
        hit = Hit(client.namespace.namespace_id, kv.shape[2], kv_keys, [])
        try:
            self.store.run(client, client.get(hit, into=kv), self.timeout_s)  # type: ignore[union-attr]
            return kv
        except (PageMissing, PageCorrupt) as exc:
            valid = getattr(exc, "num_tokens", 0)
            logger.info("kvstore HiCache read: %d of %d pages (%s)", valid // layout.page_tokens, len(keys), exc)
            return kv[:, :, :valid] if valid else None
        except (KVStoreError, TimeoutError) as exc:
            self.store.failed(client, exc)  # type: ignore[union-attr]
            return None

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Pages straight into the host pool at ``host_indices`` (page i at
        ``host_indices[i * page_size]``); True for each page now in place."""
        kv = self._read(keys)
        p = self._layout().page_tokens if self.store is not None else 1
        num = 0 if kv is None else kv.shape[2] // p
        for i in range(num):
            index = int(host_indices[i * p])
            self.pool.set_from_flat_data_page(index, to_pool_flat(kv[:, :, i * p : (i + 1) * p], self.pool.layout))  # type: ignore[index]
        return [i < num for i in range(len(keys))]

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        """One page as a flat tensor in the host pool's order (into ``target_location``
        when given), or None."""
        result = self.batch_get([key], [target_location] if target_location is not None else None)
        return result[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        kv = self._read(keys)
        num = 0 if kv is None else kv.shape[2] // self._layout().page_tokens
        out: list[torch.Tensor | None] = []
        for i in range(len(keys)):
            if i >= num:
                out.append(None)
                continue
            p = self._layout().page_tokens
            flat = to_pool_flat(kv[:, :, i * p : (i + 1) * p], self.pool.layout)  # type: ignore[index]
            if target_locations is not None and target_locations[i] is not None:
                target_locations[i].view(-1).copy_(flat)
                flat = target_locations[i]
            out.append(flat)
        return out

    # -- writes --------------------------------------------------------------------------

    def _write(self, keys: list[str], pages: list[torch.Tensor]) -> int:
        """Stores canonical pages under ``keys``; returns how many leading ones are stored. Each
        page names the generation its key's lookup answered, a key never looked up the highest the
        connection saw (DESIGN §3): a run of pages refused as stale ends the write."""
        client = self.store.client() if self.store is not None else None
        if client is None or not keys:
            return 0
        kv_keys, p = self._keys(client, keys), self._layout().page_tokens
        seen = self.store.generation_seen()  # type: ignore[union-attr]
        named = [seen if g is None else g for g in self.generations.take(kv_keys)]
        stored = 0
        while stored < len(keys):
            end = stored + 1
            while end < len(keys) and named[end] == named[stored]:
                end += 1
            run = pages[stored:end]
            kv = torch.cat(run, dim=2) if len(run) > 1 else run[0].contiguous()
            try:
                put = client.put_keys(kv_keys[stored:end], kv, generation=named[stored])
                num = self.store.run(client, put, self.timeout_s) // p  # type: ignore[union-attr]
            except StaleGeneration as exc:
                logger.info("kvstore HiCache write of %d pages refused: looked up before an invalidation (%s)",
                            len(keys) - stored, exc)
                return stored
            except (KVStoreError, TimeoutError) as exc:
                self.store.failed(client, exc)  # type: ignore[union-attr]
                return stored
            stored += num
            if stored < end:
                return stored
        return stored

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Pages straight from the host pool at ``host_indices``; True for each stored."""
        if self.pool is None:
            return [False] * len(keys)
        p = self._layout().page_tokens
        if len(host_indices) < len(keys) * p:
            logger.warning("kvstore HiCache batch_set_v1: %d host indices for %d pages of %d tokens; nothing stored",
                           len(host_indices), len(keys), p)
            return [False] * len(keys)
        pages = [canonical_page(self.pool, int(host_indices[i * p])) for i in range(len(keys))]
        stored = self._write(keys, pages)
        return [i < stored for i in range(len(keys))]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        """One page, given as a flat tensor in the host pool's order."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any | None = None, target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        """True when every page is stored; False without the pages (a zero-copy call's
        ``target_locations`` alone: batch_set_v1 takes those) or with pages not one a key."""
        if self.pool is None or values is None or any(value is None for value in values):
            return False
        shape = self.pool.get_data_page(0, flat=False).shape
        if len(values) != len(keys) or any(value.numel() != shape.numel() for value in values):
            logger.warning("kvstore HiCache batch_set: %d pages for %d keys, or a page not of %s; nothing stored",
                           len(values), len(keys), tuple(shape))
            return False
        pages = [from_pool_order(value.reshape(shape), self.pool.layout) for value in values]
        return self._write(keys, pages) == len(keys)

    def clear(self) -> None:
        """A no-op: kvstore drops a namespace with ``kvstore-ctl invalidate``, an operator's
        decision, not one engine's."""
        logger.info("kvstore HiCache backend: clear() leaves the store as it is")
