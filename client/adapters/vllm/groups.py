"""The KV cache groups of a vLLM engine, as the connector stores them.

vLLM's hybrid KV cache manager gives each kind of layer its own group with its own block
table: full attention, sliding-window attention (Gemma 2/3, gpt-oss), chunked local
attention (Llama 4), state-space layers (Mamba, linear attention). A kvstore page holds
every layer of every group for its tokens, so one page is one unit: a hit covers every
group of its pages or it is no hit. The groups (their kinds, windows and layers) are part
of the namespace: two engines whose groups differ never share pages, even when their
per-layer KV shapes agree.

Nothing here imports vLLM (the config objects are read by attribute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError

NULL_BLOCK = 0  # vLLM's null block (the first of the pool): a window group's dropped block, never data


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: what its layers attend to, and which layers it has.

    ``kind``: ``full``, ``sliding_window`` (each token attends to the ``window`` tokens
    up to itself) or ``chunked_local`` (to the tokens of its ``window``-token chunk).
    A window group's blocks that no future token attends to are dropped by vLLM (null
    blocks in the block table), so they are neither saved nor loaded."""

    kind: str
    window: int
    layer_names: tuple[str, ...]
    block_size: int

    def describe(self) -> str:
        """Canonical form for the namespace: kind, window and layer names."""
        kind = self.kind if not self.window else f"{self.kind}={self.window}"
        return f"{kind}:{','.join(self.layer_names)}"


def _group_of(group: Any) -> KVGroup:
    """A group's kind from its vLLM spec class; any other attention spec counts as full
    attention (as it always did for one group)."""
    spec = group.kv_cache_spec
    name = type(spec).__name__
    names = tuple(group.layer_names)
    if "SlidingWindow" in name:
        return KVGroup("sliding_window", int(spec.sliding_window), names, spec.block_size)
    if name == "ChunkedLocalAttentionSpec":
        return KVGroup("chunked_local", int(spec.attention_chunk_size), names, spec.block_size)
    return KVGroup("full", 0, names, spec.block_size)


@dataclass(frozen=True)
class KVGroups:
    """Every KV cache group of an engine, and its layers in the order pages hold them
    (group after group, each group's layers in vLLM's order)."""

    groups: tuple[KVGroup, ...]
    spec: Any  # the attention spec every layer shares (heads, head size, dtype)

    @classmethod
    def of(cls, kv_cache_config: Any) -> KVGroups:
        raw = list(kv_cache_config.kv_cache_groups)
        if not raw:
            raise ConfigError("the model has no KV cache groups")
        specs = [g.kv_cache_spec for g in raw]
        for spec in specs:
            if not all(hasattr(spec, name) for name in ("num_kv_heads", "head_size", "block_size", "dtype")):
                raise ConfigError(f"the kvstore connector needs an attention KV cache, got {type(spec).__name__}")
            if getattr(spec, "head_size_v", spec.head_size) not in (None, spec.head_size):
                raise ConfigError("the kvstore connector needs equal K and V head sizes (MLA is not supported yet)")
        first = specs[0]
        for spec in specs[1:]:
            shape = (spec.num_kv_heads, spec.head_size, spec.dtype, spec.block_size)
            if shape != (first.num_kv_heads, first.head_size, first.dtype, first.block_size):
                raise ConfigError(f"the kvstore connector needs one KV shape and block size for every KV cache group; "
                                  f"got {type(first).__name__} {first.num_kv_heads}x{first.head_size} {first.dtype} "
                                  f"/{first.block_size} and {type(spec).__name__} {spec.num_kv_heads}x{spec.head_size} "
                                  f"{spec.dtype} /{spec.block_size}")
        return cls(tuple(_group_of(g) for g in raw), first)

    @property
    def hybrid(self) -> bool:
        """More than one group, or a group that drops blocks: the hybrid path
        (hybrid.py); one full-attention group takes the single-group path."""
        return len(self.groups) > 1 or self.groups[0].kind != "full"

    @property
    def layer_names(self) -> list[str]:
        return [name for group in self.groups for name in group.layer_names]

    @property
    def layer_groups(self) -> list[int]:
        """For each layer of a page, the index of its group."""
        return [i for i, group in enumerate(self.groups) for _ in group.layer_names]

    def describe(self) -> tuple[str, ...]:
        """The group layout for the namespace: empty for one full-attention group (whose
        namespace is the one every single-group engine had), else one entry per group."""
        return tuple(group.describe() for group in self.groups) if self.hybrid else ()
