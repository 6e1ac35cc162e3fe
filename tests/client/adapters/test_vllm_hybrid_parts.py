"""The hybrid connector's pieces that need no engine and no store: how KV cache groups
enter the namespace, how a page's layers are copied through their groups' block tables
(null blocks included), and where the states of state-space groups go."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvstore import KVLayout
from kvstore.client.adapters.vllm.connector_settings import ConnectorConfig, engine_namespace
from kvstore.client.adapters.vllm.grouped import GroupedBlocks, pages_with_data
from kvstore.client.adapters.vllm.groups import NULL_BLOCK, KVGroups
from kvstore.client.adapters.vllm.hybrid_states import StateBlocks, state_block, state_key, state_namespace
from kvstore.errors import ConfigError, InvalidRequest

BLOCK, HEADS, DIM, NUM_BLOCKS = 32, 2, 8, 12
VLLM = SimpleNamespace(model_config=SimpleNamespace(model="m", revision=None),
                       parallel_config=SimpleNamespace(tensor_parallel_size=1))


def spec(kind: str = "FullAttentionSpec", heads: int = HEADS, **extra: Any) -> Any:
    """A stand-in for a vLLM spec class of that name (groups.py reads specs by class name)."""
    cls = type(kind, (SimpleNamespace,), {})
    return cls(num_kv_heads=heads, head_size=DIM, block_size=BLOCK, dtype=torch.float32, **extra)


def config(*groups: tuple[Any, list[str]]) -> Any:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=names) for s, names in groups])


def test_group_layout_is_part_of_the_namespace() -> None:
    """One full-attention group keeps the namespace every single-group engine had; groups
    make another, and two group layouts (other window, other layers) never share pages."""
    single = config((spec(), ["l0", "l1", "l2", "l3"]))
    plain = engine_namespace(VLLM, single, ConnectorConfig("h:1"))
    layout = KVLayout(num_layers=4, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, page_tokens=BLOCK)
    assert plain.layout == layout and not KVGroups.of(single).hybrid
    gemma = config((spec("SlidingWindowSpec", sliding_window=48), ["l0", "l2"]), (spec(), ["l1", "l3"]))
    hybrid = engine_namespace(VLLM, gemma, ConnectorConfig("h:1"))
    assert KVGroups.of(gemma).layer_names == ["l0", "l2", "l1", "l3"]
    assert hybrid.layout.groups == ("sliding_window=48:l0,l2", "full:l1,l3")
    other_window = config((spec("SlidingWindowSpec", sliding_window=64), ["l0", "l2"]), (spec(), ["l1", "l3"]))
    other_layers = config((spec("SlidingWindowSpec", sliding_window=48), ["l0", "l1"]), (spec(), ["l2", "l3"]))
    chunked = config((spec("ChunkedLocalAttentionSpec", attention_chunk_size=48), ["l0", "l2"]), (spec(), ["l1", "l3"]))
    ids = {ns.namespace_id for ns in [plain, hybrid] + [engine_namespace(VLLM, c, ConnectorConfig("h:1"))
                                                        for c in (other_window, other_layers, chunked)]}
    assert len(ids) == 5
    only_sliding = config((spec("SlidingWindowSpec", sliding_window=48), ["l0", "l1"]))
    assert KVGroups.of(only_sliding).hybrid, "a window group drops blocks: the hybrid path, even alone"


def mamba(shapes: tuple[tuple[int, ...], ...] = ((3, 8), (2, 4, 4))) -> Any:
    cls = type("MambaSpec", (SimpleNamespace,), {})
    return cls(block_size=BLOCK, shapes=shapes, dtypes=(torch.float32,) * len(shapes),
               state_content_size_bytes=sum(4 * int(torch.tensor(s).prod()) for s in shapes))


def test_state_groups_keep_states_in_a_namespace_of_their_own() -> None:
    """State-space groups enter the group layout (their state shapes too); their states
    at page boundaries live in a namespace of one state page per boundary."""
    qwen = config((mamba(), ["m0"]), (mamba(), ["m1"]), (spec(), ["a2"]))
    groups = KVGroups.of(qwen)
    assert groups.layer_names == ["a2"] and groups.state_layer_names == ["m0", "m1"]
    assert groups.layer_groups == [2] and groups.hybrid
    pages = engine_namespace(VLLM, qwen, ConnectorConfig("h:1"))
    assert pages.layout.groups[0] == "state((3, 8):float32;(2, 4, 4):float32):m0" and pages.layout.groups[2] == "full:a2"
    states = state_namespace(pages, groups)
    assert states is not None and states.layout.attention == "state" and states.layout.num_layers == 2
    assert states.layout.page_bytes == 2 * (3 * 8 + 2 * 4 * 4) * 4
    wider = ((3, 8), (2, 4, 8))
    other = engine_namespace(VLLM, config((mamba(wider), ["m0"]), (mamba(wider), ["m1"]), (spec(), ["a2"])),
                             ConnectorConfig("h:1"))
    assert other.namespace_id != pages.namespace_id, "another state shape, another namespace"
    assert state_namespace(engine_namespace(VLLM, config((spec(), ["a0"])), ConnectorConfig("h:1")),
                           KVGroups.of(config((spec(), ["a0"])))) is None
    assert state_block([0, 0, 7], 3 * BLOCK, BLOCK) == 7, "the state after token t: block (t - 1) // block_size"
    assert state_key(b"k" * 16, states.namespace_id, 0) != state_key(b"k" * 16, pages.namespace_id, 0)
    assert state_key(b"k" * 16, states.namespace_id, 0) != state_key(b"k" * 16, states.namespace_id, 1), \
        "states of pages invalidated since are not found"


def test_states_are_copied_through_their_groups_blocks() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype="uint8", page_tokens=1, attention="state")
    caches = [torch.randint(-128, 127, (NUM_BLOCKS, 1, 1, 16), dtype=torch.int8) for _ in range(2)]
    blocks = StateBlocks(caches, [0, 1], layout)
    staging = blocks.gather({0: 3, 1: 5})
    assert torch.equal(staging[0].view(-1), caches[0][3, 0, 0].view(torch.uint8))
    assert torch.equal(staging[1].view(-1), caches[1][5, 0, 0].view(torch.uint8))
    blocks.scatter(staging, {0: 9, 1: 10})
    assert torch.equal(caches[0][9], caches[0][3]) and torch.equal(caches[1][10], caches[1][5])


def test_groups_the_connector_cannot_store_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="at least one attention KV cache group"):
        KVGroups.of(config((mamba(), ["m0"])))
    with pytest.raises(ConfigError, match="one state size for every state-space group"):
        KVGroups.of(config((mamba(), ["m0"]), (mamba(((3, 8),)), ["m1"]), (spec(), ["a2"])))
    with pytest.raises(ConfigError, match="one KV shape and block size for every attention group"):
        KVGroups.of(config((spec("SlidingWindowSpec", sliding_window=48), ["l0"]), (spec(heads=4), ["l1"])))


def test_pages_with_data_end_at_the_first_null_block_of_any_group() -> None:
    full, window = [5, 6, 7, 8], [NULL_BLOCK, NULL_BLOCK, 9, 10]
    assert pages_with_data((full, window), BLOCK, BLOCK, 2, 4) == 4
    assert pages_with_data((full, window), BLOCK, BLOCK, 0, 4) == 0
    assert pages_with_data((full, window), BLOCK, BLOCK // 2, 4, 8) == 8, "half-block pages of blocks 2-3"
    assert pages_with_data((full, window[:3]), BLOCK, BLOCK, 2, 4) == 3, "past a group's table"


def test_a_page_is_copied_through_every_groups_block_table() -> None:
    """gather reads each layer from its own group's blocks; scatter writes them back there
    and never into the null block (outside a window), which stays zero."""
    layout = KVLayout(num_layers=3, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, page_tokens=BLOCK // 2)
    blocks = [torch.randn(NUM_BLOCKS, 2, BLOCK, HEADS, DIM) for _ in range(3)]
    for layer in blocks:
        layer[NULL_BLOCK].zero_()
    grouped = GroupedBlocks(blocks, [0, 1, 1], layout)  # layer 0 in group 0 (full), layers 1-2 in group 1 (window)
    tables = ([3, 4, 5], [7, 8, 9])
    pages = grouped.gather(tables, first_page=1, num_pages=4)  # tokens 16..80: blocks 0 (second half), 1, 2 (first half)
    assert torch.equal(pages[0, :, :16], blocks[0][3, :, 16:]) and torch.equal(pages[0, :, 16:48], blocks[0][4])
    assert torch.equal(pages[2, :, :16], blocks[2][7, :, 16:]) and torch.equal(pages[2, :, 48:], blocks[2][9, :, :16])
    with pytest.raises(InvalidRequest, match="null"):
        grouped.gather(([3, 4, 5], [NULL_BLOCK, 8, 9]), first_page=0, num_pages=2)

    into = [torch.zeros_like(layer) for layer in blocks]
    target = GroupedBlocks(into, [0, 1, 1], layout)
    skipped = target.scatter(pages, ([1, 2, 6], [NULL_BLOCK, 10, 11]), first_page=1)
    assert skipped == 2, "page 1 (block 0, second half) of the two window layers"
    assert int(torch.count_nonzero(torch.stack([layer[NULL_BLOCK] for layer in into]))) == 0
    assert torch.equal(into[0][1, :, 16:], pages[0, :, :16]) and torch.equal(into[0][6, :, :16], pages[0, :, 48:])
    assert torch.equal(into[1][10], pages[1, :, 16:48]) and torch.equal(into[2][11, :, :16], pages[2, :, 48:])
