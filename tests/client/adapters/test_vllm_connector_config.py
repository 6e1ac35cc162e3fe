"""The vLLM connector's pieces that need no store: its configuration errors and where its
page copies land in vLLM's CPU KV layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvstore import KVLayout
from kvstore.client.adapters.vllm.connector_settings import ConnectorConfig, engine_namespace
from kvstore.client.adapters.vllm.layout import RequestKV, block_views
from kvstore.client.adapters.vllm.pd_worker import HandoffWorker
from kvstore.errors import ConfigError

BLOCK, HEADS, DIM, LAYERS, NUM_BLOCKS = 32, 2, 32, 3, 16
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, page_tokens=BLOCK)
NAMES = [f"model.layers.{i}.attn" for i in range(LAYERS)]


def test_configuration_errors_name_what_to_fix() -> None:
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config keys \\['adress'\\]"):
        ConnectorConfig.from_extra({"adress": "x"}, environ={})
    with pytest.raises(ConfigError, match="KVSTORE_ADDRESS"):
        ConnectorConfig.from_extra({}, environ={})
    assert ConnectorConfig.from_extra({}, environ={"KVSTORE_ADDRESS": "h:1"}).address == "h:1"
    spec = SimpleNamespace(num_kv_heads=HEADS, head_size=DIM, block_size=BLOCK, dtype=torch.float32)
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=NAMES, kv_cache_spec=spec)])
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="m", revision=None),
                                  parallel_config=SimpleNamespace(tensor_parallel_size=1))
    ns = engine_namespace(vllm_config, kv_cache_config, ConnectorConfig("h:1"))
    assert ns.layout == LAYOUT and ns.revision == ""
    with pytest.raises(ConfigError, match="must divide"):
        engine_namespace(vllm_config, kv_cache_config, ConnectorConfig("h:1", page_tokens=24))
    mla = SimpleNamespace(num_kv_heads=1, head_size=DIM, head_size_v=16, block_size=BLOCK, dtype=torch.float32)
    with pytest.raises(ConfigError, match="MLA is not supported yet"):
        engine_namespace(vllm_config, SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=NAMES, kv_cache_spec=mla)]),
                         ConnectorConfig("h:1"))  # several groups: test_vllm_hybrid_parts.py


@pytest.mark.parametrize("one_buffer", [True, False])
def test_page_copies_land_where_vllms_cpu_kernels_read(one_buffer: bool) -> None:
    """A page written through RequestKV (one copy over all layers when vLLM carved them out
    of one buffer, one per layer otherwise) lands where vLLM's CPU attention reads token
    t of block b: K at row t and V at row block_size + t of ``[blocks, heads, 2*N, D]``."""
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * DIM)
    if one_buffer:
        raw = torch.zeros(LAYERS * NUM_BLOCKS * HEADS * BLOCK * 2 * DIM)
        caches = [raw[i * raw.numel() // LAYERS : (i + 1) * raw.numel() // LAYERS].view(shape) for i in range(LAYERS)]
    else:
        caches = [torch.zeros(shape) for _ in range(LAYERS)]
    layers, together = block_views(caches, BLOCK, HEADS, DIM)
    assert (together is not None) == one_buffer
    small = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, page_tokens=BLOCK // 2)
    page = torch.randn(small.page_shape())
    kv = RequestKV(layers, [7, 3], first_page=2, num_pages=2, layout=small, all_layers=together)
    kv.write_page(1, page)  # request page 3: second half of its block 1, i.e. vLLM block 3
    for layer in range(LAYERS):
        rows = caches[layer].view(NUM_BLOCKS, HEADS, 2 * BLOCK, DIM)[3]  # [heads, 2N, D], as the CPU backend reads it
        for t in range(small.page_tokens):
            assert torch.equal(rows[:, BLOCK // 2 + t], page[layer, 0, t])
            assert torch.equal(rows[:, BLOCK + BLOCK // 2 + t], page[layer, 1, t])
        assert torch.equal(kv.read_layer(1, layer), page[layer])
    assert int(torch.count_nonzero(torch.stack(caches))) == page.numel()


def test_layer_pushes_are_on_where_the_kv_is_on_an_accelerator_and_off_on_a_cpu_engine() -> None:
    """``handoff_push_layers`` "auto" (the default): a CPU engine's prefill needs the cores the
    pushes would take (DESIGN §12.7), so its layers go whole; KV on an accelerator pushes them.
    True or False is kept whatever the device; anything else is refused by name."""
    config = ConnectorConfig.from_extra({}, environ={"KVSTORE_ADDRESS": "h:1"})
    assert config.handoff_push_layers == "auto" and config.push_layers() is None
    assert ConnectorConfig("h:1", handoff_push_layers=True).push_layers() is True
    assert ConnectorConfig("h:1", handoff_push_layers=False).push_layers() is False
    for bad in (1, "yes", None):
        with pytest.raises(ConfigError, match="handoff_push_layers"):
            ConnectorConfig("h:1", handoff_push_layers=bad)
    store = SimpleNamespace(namespace=SimpleNamespace(layout=LAYOUT))
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * DIM)
    for device, setting, pushes in (("cpu", None, False), ("meta", None, True), ("cpu", True, True), ("meta", False, False)):
        worker = HandoffWorker(store, BLOCK, open_timeout_s=1.0, complete_timeout_s=1.0, push_layers=setting)  # type: ignore[arg-type]
        worker.register([torch.empty(shape, device=device) for _ in range(LAYERS)])
        assert worker.push_layers is pushes, (device, setting)
