"""kvstore-bench vllm-stall: would async loads (vLLM's ``load_kv_async``: the request waits
while its KV is copied beside the engine's steps, reported through ``get_finished``) serve
better than the connector's loads inside the step?

More: bench/vllm/README.md (### vllm_stall.py).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvstore.bench.common.harness import start_server
from kvstore.bench.vllm import vllm_bench


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-tokens", type=int, default=2048, help="H's stored prefix (the hit)")
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--sync-load-pages", type=int, default=4, help="the connector's sync_load_pages (its default: 4)")
    p.add_argument("--dir", default="bench-out/vllm-stall")


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _fetch(store: Any, client: Any, hit: Any, into: torch.Tensor, took: list[float]) -> None:
    start = time.perf_counter()
    store.run(client, client.get(hit, into=into), 60)
    took.append(time.perf_counter() - start)


def _trials(args: argparse.Namespace, address: str, model: Path, bar: tqdm) -> list[dict[str, Any]]:
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    max_len = args.prompt_tokens + args.suffix_tokens + 64
    transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.client.adapters.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"address": address, "load_deadline_s": 30,
                                                           "sync_load_pages": args.sync_load_pages})
    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
              block_size=args.block_size, max_model_len=max_len, enable_prefix_caching=False,
              kv_transfer_config=transfer, disable_log_stats=True, max_num_batched_tokens=max_len)
    engine, worker = llm.llm_engine, get_kv_transfer_group().worker
    rng = random.Random(1)
    prefix = [rng.randrange(1, 2048) for _ in range(args.prompt_tokens)]
    llm.generate([{"prompt_token_ids": prefix + [5]}], SamplingParams(max_tokens=1), use_tqdm=False)  # stores it
    if not worker.wait_saves(120):
        raise RuntimeError("the prefix was not saved")
    store = worker.store
    client = store.client()
    assert client is not None
    layout = client.layout

    def steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            start = time.perf_counter()
            engine.step()
            out.append(time.perf_counter() - start)
        return out

    rows = []
    for trial in range(args.trials):
        decoding = [rng.randrange(1, 2048) for _ in range(64)]
        engine.add_request(f"D{trial}", {"prompt_token_ids": decoding}, SamplingParams(max_tokens=1000, ignore_eos=True))
        steps(3)
        decode_s = _median(steps(15))
        loaded = worker.stats.loaded_tokens
        hit_prompt = prefix + [rng.randrange(1, 2048) for _ in range(args.suffix_tokens)]
        engine.add_request(f"H{trial}", {"prompt_token_ids": hit_prompt}, SamplingParams(max_tokens=1))
        in_step_s = steps(1)[0]  # H's prefill with its load, and D's decode step
        if worker.stats.loaded_tokens - loaded != args.prompt_tokens:
            raise RuntimeError("H did not load its hit from kvstore")
        steps(5)
        hit = store.run(client, client.lookup(prefix), 30)
        into = torch.empty(layout.num_layers, 2, hit.num_tokens, layout.num_kv_heads, layout.head_dim,
                           dtype=layout.torch_dtype())
        fetched: list[float] = []
        fetcher = threading.Thread(target=_fetch, args=(store, client, hit, into, fetched), name="bench-fetch")
        fetcher.start()
        beside: list[float] = []
        while fetcher.is_alive():
            beside += steps(1)
        fetcher.join()
        engine.abort_request([f"D{trial}"])
        steps(2)
        rows.append({"trial": trial, "decode_step_ms": round(decode_s * 1e3, 1),
                     "in_step_ttft_ms": round(in_step_s * 1e3, 1),
                     "in_step_stall_ms": round((in_step_s - decode_s) * 1e3, 1),
                     "beside_fetch_ms": round(fetched[0] * 1e3, 1), "beside_steps": len(beside),
                     "beside_stall_ms": round((sum(beside) - len(beside) * decode_s) * 1e3, 1)})
        bar.update(1)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    server, address = start_server(workdir, 1 << 30, 64 << 20, "--tiers", "host")
    try:
        model = vllm_bench._model(workdir / "model", args)
        with tqdm(total=args.trials, desc="vllm-stall", unit="trial", disable=None) as bar:
            rows = _trials(args, address, model, bar)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"prompt_tokens": args.prompt_tokens, "layers": args.layers, "hidden": args.hidden,
            "in_step": "leased copy" if args.sync_load_pages * args.block_size >= args.prompt_tokens else "layer-wise",
            "load_average_1m": round(os.getloadavg()[0], 2), "trials": rows}


def print_table(report: dict[str, Any]) -> None:
    print(f"a {report['prompt_tokens']}-token kvstore hit arriving beside a decoding request ({report['layers']} layers x "
          f"hidden {report['hidden']}, load average {report['load_average_1m']}; in-step: {report['in_step']}):")
    print(f"{'trial':>5} {'decode ms':>10} {'in-step: TTFT ms':>17} {'D stall ms':>11} {'beside: fetch ms':>17} "
          f"{'steps':>6} {'D stall ms':>11}")
    for r in report["trials"]:
        print(f"{r['trial']:>5} {r['decode_step_ms']:>10.1f} {r['in_step_ttft_ms']:>17.1f} {r['in_step_stall_ms']:>11.1f} "
              f"{r['beside_fetch_ms']:>17.1f} {r['beside_steps']:>6} {r['beside_stall_ms']:>11.1f}")
