"""The time-to-first-token part of ``kvstore-bench vllm``: one engine, arms interleaved.

More: bench/vllm/README.md (### vllm_ttft.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

MODES = ("recompute", "vllm-prefix-cache", "kvstore-hit", "kvstore-load-all")


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _policy(llm: Any) -> Any:
    """The scheduler side's LoadPolicy of an in-process engine (the bench switches it per arm)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler.policy


def ttft(args: argparse.Namespace, address: str, model: Path, bar: tqdm) -> dict[str, Any]:
    """Median seconds to the first token per mode, through ``LLM.generate`` (max_tokens=1)."""
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvstore.bench.common.linkproxy import LinkProxy
    from kvstore.client.adapters.vllm import KVStoreConnector

    proxy = LinkProxy(address, args.link_gbps * 1e9) if args.link_gbps else None
    extra: dict[str, Any] = {"address": address}
    if proxy is not None:  # another host's path: gRPC through the link, no shared memory, no call socket
        extra = {"address": proxy.address, "use_shm": False, "use_call_socket": False, "lookup_timeout_s": 5.0}
    transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.client.adapters.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    max_len = args.prompt_tokens + args.suffix_tokens + 64
    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
              block_size=args.block_size, max_model_len=max_len, enable_prefix_caching=True, kv_transfer_config=transfer,
              disable_log_stats=True, max_num_batched_tokens=max_len)
    connector = get_kv_transfer_group()
    assert isinstance(connector, KVStoreConnector) and connector.worker is not None
    policy = _policy(llm)
    rng = random.Random(1)

    def generate(prompt: list[int], skip: bool = False) -> tuple[float, list[int]]:
        params = SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=skip or None)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]  # type: ignore[arg-type]
        return time.perf_counter() - start, [out.num_cached_tokens or 0, *out.outputs[0].token_ids]

    def saved() -> None:
        # a miss's save runs behind it: let it end so that it shares the cores with no measurement
        if not connector.worker.wait_saves(600):
            raise RuntimeError("the connector's save did not finish")

    def reset() -> None:
        # The blocks of a request whose save was in flight when it finished come back at
        # the engine's next step (in-process, LLM.generate does not step an idle engine).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if llm.reset_prefix_cache():
                return
            llm.llm_engine.step()
            time.sleep(0.01)
        raise RuntimeError("vLLM's prefix cache could not be reset")

    def hit(prompt: list[int], decide: bool) -> tuple[float, list[int]]:
        reset()
        policy.enabled = decide
        try:
            return generate(prompt)
        finally:
            policy.enabled = True

    try:
        generate([rng.randrange(1, 2048) for _ in range(64)])  # warm-up: a step of this engine
        warm = [rng.randrange(1, 2048) for _ in range(args.prompt_tokens + args.suffix_tokens)]
        generate(warm, skip=True)
        saved()
        hit(warm, decide=True)  # warm-up: the connector measures a load over this path
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        cached: dict[str, list[int]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            prompt = [rng.randrange(1, 2048) for _ in range(args.prompt_tokens + args.suffix_tokens)]
            results = {"recompute": generate(prompt, skip=True)}
            saved()
            results["vllm-prefix-cache"] = generate(prompt)
            order = ("kvstore-hit", "kvstore-load-all") if repeat % 2 == 0 else ("kvstore-load-all", "kvstore-hit")
            for mode in order:
                results[mode] = hit(prompt, decide=mode == "kvstore-hit")
            for mode, (seconds, out) in results.items():
                times[mode].append(seconds)
                cached[mode].append(out[0])
                if out[1:] != results["recompute"][1][1:]:
                    raise RuntimeError(f"{mode} produced another first token than recompute")
            bar.update(1)
    finally:
        if proxy is not None:
            proxy.close()
    medians = {mode: _median(times[mode]) for mode in MODES}
    # per repeat, beside the recompute of the same prefix: steadier than a ratio of medians while the host's load drifts
    paired = {mode: _median([t / r for t, r in zip(times[mode], times["recompute"])]) for mode in MODES}
    rows = [{"mode": mode, "link_gbps": args.link_gbps, "ttft_s": round(medians[mode], 4),
             "num_cached_tokens": sorted(cached[mode])[len(cached[mode]) // 2], "ttft_s_each": [round(t, 4) for t in times[mode]],
             "vs_recompute": round(medians[mode] / medians["recompute"], 3), "vs_recompute_paired": round(paired[mode], 3),
             "vs_vllm_prefix_cache": round(medians[mode] / medians["vllm-prefix-cache"], 3),
             "vs_load_all": round(medians[mode] / medians["kvstore-load-all"], 3)}
            for mode in MODES]
    fetch, per_token = policy.costs.fetch.line(), policy.costs.recompute.line().per_unit_s
    model = {"fetch_per_call_ms": round(fetch.fixed_s * 1e3, 3),
             "fetch_gbps": round(1e-9 / fetch.per_unit_s, 4) if fetch.per_unit_s > 0 else None,
             "recompute_ms_per_token": round(per_token * 1e3, 4), "bytes_per_token": policy.bytes_per_token,
             "fetch_prefix_ms": round(policy.costs.fetch_s(args.prompt_tokens) * 1e3, 1),
             "recompute_prefix_ms": round(policy.costs.recompute_s(args.prompt_tokens) * 1e3, 1)}
    where = "direct" if args.link_gbps is None else f"{args.link_gbps:g} GB/s"
    return {"ttft": rows, "link_gbps": args.link_gbps, "cost_model": {where: model}, "load_stats": {where: vars(policy.stats)}}


def run_links(args: argparse.Namespace, links: list[float]) -> dict[str, Any]:
    """One child ``kvstore-bench vllm --link-gbps X --json`` per rate (a vLLM engine per
    process), in turn; their rows merged."""
    merged: dict[str, Any] = {"ttft": [], "cost_model": {}, "load_stats": {}, "small_hits": [], "load_average_1m": []}
    for gbps in links:
        argv = [sys.executable, "-m", "kvstore.bench.main", "--log-level", args.log_level, "vllm", "--json", "--plot", "",
                "--link-gbps", str(gbps), "--dir", f"{args.dir}-{gbps:g}"]
        for flag in ("prompt_tokens", "suffix_tokens", "layers", "hidden", "kv_heads", "head_dim", "block_size", "repeats"):
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True).stdout
        child = json.loads(out.strip().splitlines()[-1])
        for key in ("ttft", "cost_model", "load_stats"):
            merged[key] = merged[key] + child[key] if key == "ttft" else merged[key] | child[key]
        merged["load_average_1m"].append(child["load_average_1m"])
        merged |= {k: child[k] for k in ("prompt_tokens", "suffix_tokens", "layers", "hidden", "block_size")}
    return merged
