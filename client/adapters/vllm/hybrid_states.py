"""States of a hybrid engine's state-space groups (Mamba, linear attention) at page
boundaries.

More: client/adapters/vllm/README.md (### hybrid_states.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

import torch

from kvstore.client.adapters.vllm.groups import KVGroups
from kvstore.errors import ConfigError, InvalidRequest
from kvstore.types import KVLayout, Namespace

STATE_PERSON = b"kvstore-state-v1"
MAX_DIM = 1 << 16  # the server's bound on a layout's head_dim (kvstore/validate.py): a state is cut into "heads" of at most this


def state_namespace(pages: Namespace, groups: KVGroups) -> Namespace | None:
    """The namespace of the states at page boundaries (None without state-space groups):
    the pages' model, revision, shard and salt, a layout of one state per layer
    (``attention="state"``), and the pages' group layout and page size (which boundaries
    its states are at)."""
    if not groups.state_groups:
        return None
    size = groups.state_groups[0].state_bytes
    heads = next(k for k in range(1, size + 1) if size % k == 0 and size // k <= MAX_DIM)
    if heads > MAX_DIM:
        raise ConfigError(f"a state of {size} bytes cannot be cut into at most {MAX_DIM} parts of at most {MAX_DIM} bytes")
    lay = pages.layout
    layout = KVLayout(num_layers=len(groups.state_layer_names), num_kv_heads=heads, head_dim=size // heads, dtype="uint8",
                      page_tokens=1, attention="state", groups=(*lay.groups, f"page_tokens={lay.page_tokens}"))
    return replace(pages, layout=layout)


def state_key(page_key: bytes, state_namespace_id: bytes, generation: int) -> bytes:
    """The key of the state after the page whose key is ``page_key`` (its chain covers
    every token before the boundary), in the state namespace (salted like the pages).
    ``generation``: the pages' namespace generation the state was computed in (a lookup's
    ``Hit.generation``): invalidating the pages retires their states with them, though
    the state namespace itself is not invalidated."""
    return hashlib.blake2b(page_key + state_namespace_id + generation.to_bytes(8, "little"), digest_size=16,
                           person=STATE_PERSON).digest()


def state_block(block_ids: Sequence[int], boundary: int, block_size: int) -> int:
    """The block of a state group's table that holds the state after token ``boundary``."""
    index = (boundary - 1) // block_size
    if index >= len(block_ids):
        raise InvalidRequest(f"the state after token {boundary} lies past the {len(block_ids)} blocks of the request")
    return block_ids[index]


class StateBlocks:
    """Every state layer's blocks as bytes (``[blocks, state_bytes]`` views of vLLM's
    ``[blocks, 1, 1, state_bytes]`` int8 caches), each with its group's index."""

    def __init__(self, caches: Sequence[torch.Tensor], layer_groups: Sequence[int], layout: KVLayout) -> None:
        self.layout = layout
        self.layer_groups = list(layer_groups)
        size = layout.num_kv_heads * layout.head_dim
        self.states = []
        for cache in caches:
            if cache.dim() != 4 or cache.shape[1:3] != (1, 1) or cache.shape[3] != size or cache.stride(3) != 1:
                raise InvalidRequest(f"unsupported vLLM state cache {list(cache.shape)} (stride {cache.stride()}); "
                                     f"expected [blocks, 1, 1, {size}] bytes")
            self.states.append(cache[:, 0, 0, :].view(torch.uint8))

    def staging(self) -> torch.Tensor:
        lay = self.layout
        return torch.empty((lay.num_layers, 1, 1, lay.num_kv_heads, lay.head_dim), dtype=torch.uint8,
                           device=self.states[0].device)

    def gather(self, blocks: dict[int, int]) -> torch.Tensor:
        """Every state layer's state from the block ``blocks[group]`` of its group."""
        out = self.staging()
        for layer, group in enumerate(self.layer_groups):
            out[layer].view(-1).copy_(self.states[layer][blocks[group]])
        return out

    def scatter(self, staging: torch.Tensor, blocks: dict[int, int]) -> None:
        for layer, group in enumerate(self.layer_groups):
            self.states[layer][blocks[group]].copy_(staging[layer].reshape(-1))
