"""Leaf value types everyone may import: KVLayout, Namespace, PageKey, Location.

No torch import at module level: the server never builds a ``KVLayout`` (it works with
``page.LayoutDesc``), so only clients pay for importing torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from kvstore.errors import ConfigError

NAMESPACE_ID_BYTES = 16
MAX_GENERATION = (1 << 63) - 1  # a namespace generation a call may name: room left above (DESIGN §12.4)
PAGE_KEY_BYTES = 16

# Bytes per element of the dtypes a page may hold.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

# "state": a page holds one state per layer (a state-space layer's conv and SSM state as
# ``head_dim`` bytes, ``page_tokens`` 1), the state after the tokens its key chains.
ATTENTION_KINDS = ("gqa", "mla", "state")

# Tier names, fastest first: the order a reader prefers copies in. Only the first three can
# be this node's own (--tiers); "remote" is a copy held by another node.
TIER_NAMES = ("hbm", "host", "ssd", "remote")
LOCAL_TIER_NAMES = TIER_NAMES[:3]
REMOTE_TIER = "remote"


def page_bytes_of(num_layers: int, kv_factor: int, num_kv_heads: int, head_dim: int, dtype: str, page_tokens: int) -> int:
    """Bytes of one page: every layer's K (and V) for ``page_tokens`` tokens; 0 for an
    unknown dtype. The one formula behind KVLayout.page_bytes and LayoutDesc.page_bytes."""
    return num_layers * kv_factor * num_kv_heads * head_dim * DTYPE_BYTES.get(dtype, 0) * page_tokens


def dtype_name(dtype: Any) -> str:
    """'bfloat16' for torch.bfloat16 or 'bfloat16'; raises ConfigError for anything else."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}")
    return name


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV of one model shard, and how it is cut into pages.

    A page holds ``page_tokens`` tokens of every layer, laid out layer-major:
    ``[layer][K|V][token][head][dim]`` so that one layer of a page is one contiguous slice.
    MLA keeps a single latent per token (``attention="mla"``: no separate K and V).
    ``groups``: an engine's KV cache groups when it has several kinds of layers (full,
    sliding-window, chunked attention), each group's kind and layers in page order
    (client/adapters/vllm/groups.py); part of the namespace id, so that engines whose
    groups differ never share pages. Empty for one full-attention group.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Any = "bfloat16"  # a torch.dtype (a name like "bfloat16" is converted)
    page_tokens: int = 16
    attention: str = "gqa"
    groups: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        name = dtype_name(self.dtype)
        import torch

        object.__setattr__(self, "dtype", getattr(torch, name))
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value > 1 << 20:
                raise ConfigError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"KVLayout.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")

    @property
    def kv_factor(self) -> int:
        """2 when K and V are stored separately, 1 for an MLA latent or a state."""
        return 1 if self.attention in ("mla", "state") else 2

    @cached_property
    def dtype_name(self) -> str:  # cached, as page_bytes: the copy paths ask per page (0.46 us each, 0.05 cached)
        return dtype_name(self.dtype)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype_name]

    @property
    def bytes_per_token(self) -> int:
        return page_bytes_of(self.num_layers, self.kv_factor, self.num_kv_heads, self.head_dim, self.dtype_name, 1)

    @cached_property
    def page_bytes(self) -> int:
        return page_bytes_of(self.num_layers, self.kv_factor, self.num_kv_heads, self.head_dim, self.dtype_name, self.page_tokens)

    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.kv_factor, self.page_tokens, self.num_kv_heads, self.head_dim)

    def torch_dtype(self) -> Any:
        return self.dtype

    def describe(self) -> dict[str, Any]:
        """Canonical, JSON-able form; part of the namespace id (``groups`` only when set:
        a single-group engine keeps the namespace id it always had)."""
        described: dict[str, Any] = {
            "num_layers": self.num_layers,
            "kv_factor": self.kv_factor,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype_name,
            "page_tokens": self.page_tokens,
            "attention": self.attention,
        }
        if self.groups:
            described["groups"] = list(self.groups)
        return described

    @classmethod
    def from_hf_config(cls, config: Any, dtype: Any = "bfloat16", page_tokens: int = 16) -> KVLayout:
        """Derives the layout of a Hugging Face decoder config (GQA/MHA)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, dtype=dtype, page_tokens=page_tokens)


@dataclass(frozen=True)
class Namespace:
    """Everything that decides which computation produced a KV page.

    Two requests may share pages only if every field is equal: same weights revision, same
    adapter, same KV format and the same tensor-parallel shard. ``tenant_salt`` separates
    tenants so that one can neither read nor probe another's prefixes.
    """

    model: str
    revision: str
    layout: KVLayout
    adapter: str = ""
    adapter_revision: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    tenant_salt: str = ""
    namespace_id: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("Namespace.model must not be empty")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"Namespace.tp_rank must be in [0, tp_size), got {self.tp_rank}/{self.tp_size}")
        canonical = json.dumps(
            {
                "v": 1,
                "model": self.model,
                "revision": self.revision,
                "adapter": self.adapter,
                "adapter_revision": self.adapter_revision,
                "layout": self.layout.describe(),
                "tp": [self.tp_rank, self.tp_size],
                "tenant_salt": self.tenant_salt,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        digest = hashlib.blake2b(canonical, digest_size=NAMESPACE_ID_BYTES, person=b"kvstore-ns-v1").digest()
        object.__setattr__(self, "namespace_id", digest)


class Location(NamedTuple):
    """Where a page's bytes are: which node, which tier, which version of the entry.
    (A NamedTuple: a restart creates one per stored page, and it must be cheap.)"""

    node: str
    tier: str
    version: int
    size_bytes: int


class LocationRun(NamedTuple):
    """``num_pages`` consecutive pages of a prefix whose best copies are all on ``node`` in
    ``tier``, each of ``size_bytes``: how a lookup answers, so that a prefix held in one
    place is one record, not one per page."""

    node: str
    tier: str
    num_pages: int
    size_bytes: int
