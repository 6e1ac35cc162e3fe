"""The KV cache groups of a vLLM engine, as the connector stores them.

More: client/adapters/vllm/README.md (### groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError

NULL_BLOCK = 0  # vLLM's null block (the first of the pool): a window group's dropped block, never data


@dataclass(frozen=True)
class KVGroup:
    """One attention KV cache group: what its layers attend to, and which layers it has.

    ``index``: the group's place in vLLM's ``kv_cache_groups`` (and in every block table
    tuple vLLM hands out). ``kind``: ``full``, ``sliding_window`` (each token attends to
    the ``window`` tokens up to itself) or ``chunked_local`` (to the tokens of its
    ``window``-token chunk). A window group's blocks that no future token attends to are
    dropped by vLLM (null blocks in the block table), so they are neither saved nor loaded."""

    index: int
    kind: str
    window: int
    layer_names: tuple[str, ...]
    block_size: int

    def describe(self) -> str:
        """Canonical form for the namespace: kind, window and layer names."""
        kind = self.kind if not self.window else f"{self.kind}={self.window}"
        return f"{kind}:{','.join(self.layer_names)}"


@dataclass(frozen=True)
class StateGroup:
    """A state-space KV cache group (Mamba, linear attention): per layer a fixed-size state
    (``state_bytes``: conv and SSM state together) that sums up every token before it.
    vLLM keeps a request's state in a block of its table: the one at index ``(t - 1) //
    block_size`` holds the state after token t when a step ended at t. A resumed prefix
    needs exactly the state at its end, so kvstore keeps states at page boundaries
    (hybrid_states.py)."""

    index: int
    layer_names: tuple[str, ...]
    block_size: int
    state_bytes: int
    shapes: str  # the state tensors' shapes and dtypes, for the namespace

    def describe(self) -> str:
        return f"state({self.shapes}):{','.join(self.layer_names)}"


def _group_of(index: int, group: Any) -> KVGroup | StateGroup:
    """A group's kind from its vLLM spec class; any other attention spec counts as full
    attention (as it always did for one group)."""
    spec = group.kv_cache_spec
    name = type(spec).__name__
    names = tuple(group.layer_names)
    if "Mamba" in name:
        shapes = ";".join(f"{tuple(shape)}:{str(dtype).removeprefix('torch.')}" for shape, dtype in zip(spec.shapes, spec.dtypes))
        return StateGroup(index, names, spec.block_size, int(spec.state_content_size_bytes), shapes)
    if not all(hasattr(spec, attr) for attr in ("num_kv_heads", "head_size", "block_size", "dtype")):
        raise ConfigError(f"the kvstore connector needs an attention or state-space KV cache, got {name}")
    if getattr(spec, "head_size_v", spec.head_size) not in (None, spec.head_size):
        raise ConfigError("the kvstore connector needs equal K and V head sizes (MLA is not supported yet)")
    if "SlidingWindow" in name:
        return KVGroup(index, "sliding_window", int(spec.sliding_window), names, spec.block_size)
    if name == "ChunkedLocalAttentionSpec":
        return KVGroup(index, "chunked_local", int(spec.attention_chunk_size), names, spec.block_size)
    return KVGroup(index, "full", 0, names, spec.block_size)


@dataclass(frozen=True)
class KVGroups:
    """Every KV cache group of an engine. Pages hold the attention groups' layers (group
    after group, each group's layers in vLLM's order); the state groups' states are kept
    beside them, one per page boundary (hybrid_states.py)."""

    groups: tuple[KVGroup, ...]
    spec: Any  # the attention spec every attention layer shares (heads, head size, dtype, block size)
    state_groups: tuple[StateGroup, ...] = ()

    @classmethod
    def of(cls, kv_cache_config: Any) -> KVGroups:
        raw = list(kv_cache_config.kv_cache_groups)
        parsed = [_group_of(i, g) for i, g in enumerate(raw)]
        attention = tuple(g for g in parsed if isinstance(g, KVGroup))
        states = tuple(g for g in parsed if isinstance(g, StateGroup))
        if not attention:
            raise ConfigError("the kvstore connector needs at least one attention KV cache group")
        specs = [raw[g.index].kv_cache_spec for g in attention]
        first = specs[0]
        for spec in specs[1:]:
            shape = (spec.num_kv_heads, spec.head_size, spec.dtype, spec.block_size)
            if shape != (first.num_kv_heads, first.head_size, first.dtype, first.block_size):
                raise ConfigError(f"the kvstore connector needs one KV shape and block size for every attention group; "
                                  f"got {type(first).__name__} {first.num_kv_heads}x{first.head_size} {first.dtype} "
                                  f"/{first.block_size} and {type(spec).__name__} {spec.num_kv_heads}x{spec.head_size} "
                                  f"{spec.dtype} /{spec.block_size}")
        if len({g.state_bytes for g in states}) > 1:
            raise ConfigError(f"the kvstore connector needs one state size for every state-space group, got "
                              f"{sorted({g.state_bytes for g in states})} bytes")
        return cls(attention, first, states)

    @property
    def hybrid(self) -> bool:
        """More than one group, or a group that drops blocks: the hybrid sides
        (hybrid_scheduler.py, hybrid_worker.py); one full-attention group takes the
        single-group sides."""
        return len(self.groups) + len(self.state_groups) > 1 or self.groups[0].kind != "full"

    @property
    def layer_names(self) -> list[str]:
        """The attention layers, in page order."""
        return [name for group in self.groups for name in group.layer_names]

    @property
    def layer_groups(self) -> list[int]:
        """For each attention layer of a page, the index of its group in vLLM's block tables."""
        return [group.index for group in self.groups for _ in group.layer_names]

    @property
    def state_layer_names(self) -> list[str]:
        return [name for group in self.state_groups for name in group.layer_names]

    def describe(self) -> tuple[str, ...]:
        """The group layout for the namespace, in vLLM's group order: empty for one
        full-attention group (whose namespace is the one every single-group engine had),
        else one entry per group."""
        if not self.hybrid:
            return ()
        every: list[KVGroup | StateGroup] = sorted([*self.groups, *self.state_groups], key=lambda g: g.index)
        return tuple(group.describe() for group in every)
