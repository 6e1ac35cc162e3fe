"""Hugging Face ``transformers`` adapter: restore a prefix into a ``DynamicCache`` and save
a computed one.

``n, past = await cache.restore(input_ids)`` gives the number of leading tokens covered (a
page boundary, at most ``len(input_ids) - 1`` so the model always computes the last token's
logits) and a cache holding exactly them. A page that vanished or fails its checksum only
shortens ``n``: the model recomputes the rest (partial recompute), never reads garbage.
``save`` names the generation the restore of its tokens answered (DESIGN §3).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from kvstore.client.adapters.lookup_generations import LookupGenerations
from kvstore.client.client import Hit, KVStoreClient
from kvstore.client.layerwise import LayerLoad
from kvstore.errors import InvalidRequest, NamespaceMismatch, PageCorrupt, PageMissing, StaleGeneration
from kvstore.types import KVLayout

logger = logging.getLogger(__name__)


def _ids(input_ids: Any) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise InvalidRequest(f"HFKVCache handles one sequence at a time, got a batch of {input_ids.shape[0]}")
            input_ids = input_ids[0]
        return [int(t) for t in input_ids.tolist()]
    return [int(t) for t in input_ids]


class HFLayersKV:
    """EngineKV over per-layer HF tensors ``[1, heads, tokens, dim]`` (keys and values)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], layout: KVLayout) -> None:
        self.keys, self.values, self.layout = keys, values, layout
        self.num_tokens = keys[0].shape[2]

    def _span(self, page: int) -> slice:
        p = self.layout.page_tokens
        return slice(page * p, (page + 1) * p)

    def read_layer(self, page: int, layer: int) -> torch.Tensor:
        s = self._span(page)
        return torch.stack([self.keys[layer][0, :, s].transpose(0, 1), self.values[layer][0, :, s].transpose(0, 1)])

    def write_layer(self, page: int, layer: int, src: torch.Tensor) -> None:
        s = self._span(page)
        self.keys[layer][0, :, s].copy_(src[0].transpose(0, 1))
        self.values[layer][0, :, s].copy_(src[1].transpose(0, 1))


def cache_from_layers(keys: list[torch.Tensor], values: list[torch.Tensor]) -> Any:
    """A DynamicCache that references (does not copy) the given per-layer tensors."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.update(k[:, :, :0], v[:, :, :0], i)
        cache.layers[i].keys, cache.layers[i].values = k, v
    return cache


def cache_layers(past: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if hasattr(past, "layers"):
        return [layer.keys for layer in past.layers], [layer.values for layer in past.layers]
    return list(past.key_cache), list(past.value_cache)  # transformers 4.x


class HFKVCache:
    """Stores and restores transformers KV caches through a KVStoreClient."""

    def __init__(self, client: KVStoreClient, config: Any | None = None) -> None:
        self.client = client
        self.layout = client.layout
        self.generations = LookupGenerations()  # what each page's restore answered, for its save (DESIGN §3)
        if config is not None:
            derived = KVLayout.from_hf_config(config, dtype=self.layout.dtype, page_tokens=self.layout.page_tokens)
            if derived != self.layout:
                raise NamespaceMismatch(f"model config gives layout {derived}, the client's namespace has {self.layout}")

    def _check_tensors(self, keys: list[torch.Tensor]) -> None:
        lay = self.layout
        k = keys[0]
        if len(keys) != lay.num_layers or k.shape[1] != lay.num_kv_heads or k.shape[3] != lay.head_dim or k.dtype != lay.dtype:
            raise NamespaceMismatch(
                f"cache has {len(keys)} layers of {list(k.shape)} {k.dtype}; the namespace layout is {lay} — "
                "refusing to mix KV of different models"
            )

    def _empty(self, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        lay = self.layout
        shape = (1, lay.num_kv_heads, tokens, lay.head_dim)
        return ([torch.empty(shape, dtype=lay.dtype) for _ in range(lay.num_layers)],
                [torch.empty(shape, dtype=lay.dtype) for _ in range(lay.num_layers)])

    async def _lookup(self, ids: list[int]) -> Hit:
        """The stored prefix of all but the last token; its generation is kept for every page looked
        up, stored or not: the model computes the rest on the prefix, and ``save`` names it."""
        tokens = ids[: max(0, len(ids) - 1)]
        hit = await self.client.lookup(tokens)
        if len(tokens) >= self.layout.page_tokens:
            self.generations.remember(self.client.keys(tokens), hit.generation)
        return hit

    async def restore(self, input_ids: Any) -> tuple[int, Any]:
        ids = _ids(input_ids)
        hit = await self._lookup(ids)
        if hit.num_tokens == 0:
            return 0, None
        keys, values = self._empty(hit.num_tokens)
        n = hit.num_tokens
        try:
            await self.client.get(hit, into=HFLayersKV(keys, values, self.layout))
        except (PageMissing, PageCorrupt) as exc:
            n = getattr(exc, "num_tokens", 0)
            logger.warning("restore: %s; recomputing from token %d", exc, n)
        if n == 0:
            return 0, None
        return n, cache_from_layers([k[:, :, :n] for k in keys], [v[:, :, :n] for v in values])

    async def save(self, input_ids: Any, past: Any, durable: bool = False, generation: int | None = None) -> int:
        """Stores the full pages of a computed cache; returns the leading tokens stored. It names
        ``generation`` (a ``Hit``'s), else the lowest a restore of its pages answered since they were
        last saved, else the highest the client saw: 0 tokens once an invalidation raised it."""
        ids = _ids(input_ids)
        keys, values = cache_layers(past)
        self._check_tensors(keys)
        tokens = min(len(ids), keys[0].shape[2])
        page_keys = self.client.keys(ids[:tokens])
        restored = [g for g in self.generations.take(page_keys) if g is not None]
        if generation is None:
            generation = min(restored) if restored else self.client.generation_seen
        try:
            return await self.client.put_keys(page_keys, HFLayersKV(keys, values, self.layout), durable=durable,
                                              generation=generation)
        except StaleGeneration as exc:
            logger.info("save refused: the cache was computed before an invalidation (%s)", exc)
            return 0

    async def restore_layerwise(self, input_ids: Any, ahead: int = 0, deadline_s: float | None = None) -> tuple[int, Any, LayerLoad | None]:
        """Starts a layer-wise load; returns (n, past, load) once the valid prefix is known.
        Run the model inside ``wait_per_layer(model, load)`` so each decoder layer waits for
        its own KV only. n is 0 (and past None) when nothing usable is stored."""
        ids = _ids(input_ids)
        hit = await self._lookup(ids)
        if hit.num_tokens == 0:
            return 0, None, None
        keys, values = self._empty(hit.num_tokens)
        load = self.client.load(hit, into=HFLayersKV(keys, values, self.layout), ahead=ahead, deadline_s=deadline_s)
        if not load.wait(0):
            return 0, None, None
        n = load.num_tokens
        if n == 0:
            return 0, None, None
        return n, cache_from_layers([k[:, :, :n] for k in keys], [v[:, :, :n] for v in values]), load


class LoadAbandoned(RuntimeError):
    """Raised inside the model's forward when a layer's KV did not arrive in time, or a
    page failed its check once copied: recompute from ``load.num_tokens``."""


@contextlib.contextmanager
def wait_per_layer(model: Any, load: LayerLoad | None) -> Iterator[None]:
    """Installs a pre-hook on every decoder layer that waits for that layer's KV."""
    if load is None:
        yield
        return
    layers = model.model.layers
    handles = []
    for i, layer in enumerate(layers):
        def hook(_module: Any, _args: Any, i: int = i) -> None:
            if not load.wait(i):
                raise LoadAbandoned(f"layer {i}: the load was abandoned or a page failed its check; "
                                    f"{load.num_tokens} tokens are valid")
        handles.append(layer.register_forward_pre_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
