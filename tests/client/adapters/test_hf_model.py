"""A cache hit changes nothing but time: greedy output with kvstore hits equals the output
without any cache, token for token, with a real transformers model (random weights)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest
import torch
from support.hf_model import greedy, namespace_for, tiny_qwen3
from support.servers import flip_arena_byte

from kvstore import KVLayout, Namespace
from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.client.adapters.hf import HFKVCache, wait_per_layer
from kvstore.errors import NamespaceMismatch

torch.set_num_threads(1)
BASE = torch.Generator().manual_seed(1)
BASE_PROMPT = torch.randint(0, 512, (1, 200), generator=BASE)
SHARED = [0, 5, 16, 31, 32, 100, 160, 199, 200]  # tokens shared with the stored prompt


@pytest.fixture(scope="module")
def model_and_config():
    return tiny_qwen3()


def _prompt(shared: int, seed: int) -> torch.Tensor:
    suffix = torch.randint(0, 512, (1, 37), generator=torch.Generator().manual_seed(seed))
    if shared == 200:
        return BASE_PROMPT.clone()
    return torch.cat([BASE_PROMPT[:, :shared], suffix], dim=1)


async def _store_base(cache: HFKVCache, model) -> None:
    with torch.no_grad():
        past = model(BASE_PROMPT, use_cache=True).past_key_values
    assert await cache.save(BASE_PROMPT, past) == 192


async def test_generation_with_hits_equals_without(server, model_and_config) -> None:
    model, config = model_and_config
    async with KVStoreClient(server.address, namespace_for(config)) as client:
        cache = HFKVCache(client, config)
        await _store_base(cache, model)
        for i, shared in enumerate(SHARED):
            ids = _prompt(shared, seed=100 + i)
            n, past = await cache.restore(ids)
            assert n == min(shared // 16 * 16, (ids.shape[1] - 1) // 16 * 16)
            with torch.no_grad():
                if n:
                    full = model(ids).logits[0, -1]
                    _, past2 = await cache.restore(ids)
                    cached = model(ids[:, n:], past_key_values=past2).logits[0, -1]
                    torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)
                assert greedy(model, ids, past) == greedy(model, ids), f"shared={shared} n={n}"


async def test_layerwise_restore_equals_without(server, model_and_config) -> None:
    model, config = model_and_config
    async with KVStoreClient(server.address, namespace_for(config)) as client:
        cache = HFKVCache(client, config)
        await _store_base(cache, model)
        ids = _prompt(160, seed=7)
        n, past, load = await cache.restore_layerwise(ids, ahead=1, deadline_s=30)
        assert n == 160 and load is not None
        with torch.no_grad(), wait_per_layer(model, load):
            out = greedy(model, ids, past)
        assert await load.finished() == 160
        assert out == greedy(model, ids)


WRITER = textwrap.dedent(
    """
    import asyncio, sys, torch
    sys.path.insert(0, sys.argv[2])
    from support.hf_model import tiny_qwen3, namespace_for
    from kvstore.client import KVStoreClient
    from kvstore.client.adapters.hf import HFKVCache
    base = torch.randint(0, 512, (1, 200), generator=torch.Generator().manual_seed(1))
    model, config = tiny_qwen3()
    async def main():
        async with KVStoreClient(sys.argv[1], namespace_for(config)) as client:
            with torch.no_grad():
                past = model(base, use_cache=True).past_key_values
            print(await HFKVCache(client, config).save(base, past))
    asyncio.run(main())
    """
)


async def test_cache_written_by_another_process(server, model_and_config) -> None:
    model, config = model_and_config
    tests_dir = str(Path(__file__).resolve().parents[2])  # tests/, where the support package lives
    res = subprocess.run([sys.executable, "-c", WRITER, server.address, tests_dir],  # noqa: ASYNC221 - waits for the writer
                         check=False, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "192", res.stderr[-2000:]
    async with KVStoreClient(server.address, namespace_for(config)) as client:
        cache = HFKVCache(client, config)
        ids = _prompt(100, seed=9)
        n, past = await cache.restore(ids)
        assert n == 96
        assert greedy(model, ids, past) == greedy(model, ids)


@pytest.mark.parametrize("fault", ["delete", "corrupt"])
async def test_fault_between_lookup_and_load_still_identical(server, model_and_config, fault) -> None:
    model, config = model_and_config
    ns = namespace_for(config)
    async with KVStoreClient(server.address, ns) as client:
        cache = HFKVCache(client, config)
        await _store_base(cache, model)
        ids = _prompt(200, seed=11)
        real_lookup = client.lookup

        async def lookup_then_fault(tokens):  # type: ignore[no-untyped-def]
            hit = await real_lookup(tokens)
            victim = hit.keys[5]
            if fault == "delete":
                async with grpc.aio.insecure_channel(server.address) as ch:
                    await directory_pb2_grpc.DirectoryStub(ch).Remove(
                        directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=[victim]))
            else:
                flip_arena_byte(server, server.core.where(victim)["host"] + 333)
            return hit

        client.lookup = lookup_then_fault  # type: ignore[method-assign]
        n, past = await cache.restore(ids)
        client.lookup = real_lookup  # type: ignore[method-assign]
        assert n == 80, "the valid prefix ends before the damaged page"
        assert greedy(model, ids, past) == greedy(model, ids)


async def test_layout_mismatch_is_a_clear_error(server, model_and_config) -> None:
    model, config = model_and_config
    wrong = Namespace(model="tiny-qwen3", revision="x", layout=KVLayout(3, 2, 64, dtype=torch.float32))
    async with KVStoreClient(server.address, wrong) as client:
        with pytest.raises(NamespaceMismatch, match="layout"):
            HFKVCache(client, config)
        with torch.no_grad():
            past = model(BASE_PROMPT, use_cache=True).past_key_values
        with pytest.raises(NamespaceMismatch, match="refusing"):
            await HFKVCache(client).save(BASE_PROMPT, past)


async def test_the_check_catches_wrong_kv(server, model_and_config) -> None:
    """Negative control: a restored cache with slightly wrong KV must fail the logit check
    (so the equality tests above can catch a 'garbage after a cache hit' bug)."""
    model, config = model_and_config
    async with KVStoreClient(server.address, namespace_for(config)) as client:
        cache = HFKVCache(client, config)
        await _store_base(cache, model)
        ids = _prompt(160, seed=13)
        n, past = await cache.restore(ids)
        past.layers[1].keys[0, :, 40:56] += 0.05 * torch.randn_like(past.layers[1].keys[0, :, 40:56])
        with torch.no_grad():
            full = model(ids).logits[0, -1]
            cached = model(ids[:, n:], past_key_values=past).logits[0, -1]
        assert not torch.allclose(cached, full, atol=1e-4, rtol=1e-4)
