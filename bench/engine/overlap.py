"""kvstore-bench overlap: prefill of N new tokens after a hit of H tokens on a real
transformers model (CPU), in three modes:

* serial: load the whole hit, then compute;
* layerwise: layer i computes as soon as layer i's KV is in place;
* layerwise-ahead: the same with ``ahead`` layers preloaded, ``ahead`` proposed by the
  client's helper from the measured bandwidth (S_buf = B·(T_read − T_new)).

More: bench/engine/README.md (### overlap.py).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvstore import KVLayout, Namespace
from kvstore.bench.common.harness import start_server
from kvstore.client import KVStoreClient
from kvstore.client.adapters.hf import HFKVCache, HFLayersKV, cache_from_layers, wait_per_layer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hit-tokens", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="bench-out/overlap")


def build_model(args: argparse.Namespace) -> tuple[Any, Any]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 2, num_hidden_layers=args.layers,
        num_attention_heads=max(args.kv_heads, args.hidden // args.head_dim), num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=args.hit_tokens + args.new_tokens + 16, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval(), config


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


async def _measure(args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, config = build_model(args)
    layout = KVLayout.from_hf_config(config, dtype=torch.float32, page_tokens=16)
    ns = Namespace(model="bench-qwen3", revision="overlap", layout=layout)
    ids = torch.randint(0, 1024, (1, args.hit_tokens + args.new_tokens), generator=torch.Generator().manual_seed(1))
    prefix = ids[:, : args.hit_tokens]
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    hit_bytes = args.hit_tokens * layout.bytes_per_token
    server, addr = start_server(workdir, hit_bytes * 2 + (64 << 20), 64 << 20, "--tiers", "host")
    try:
        async with KVStoreClient(addr, ns, lease_ms=120_000) as client:
            cache = HFKVCache(client, config)
            with torch.no_grad():
                past = model(prefix, use_cache=True).past_key_values
            stored = await cache.save(prefix, past)
            assert stored == args.hit_tokens // 16 * 16
            hit = await client.lookup(ids[0].tolist())
            h = hit.num_tokens
            shape = (1, layout.num_kv_heads, h, layout.head_dim)
            keys = [torch.zeros(shape) for _ in range(layout.num_layers)]
            values = [torch.zeros(shape) for _ in range(layout.num_layers)]
            suffix = ids[:, h:]
            reference = None

            def compute() -> torch.Tensor:
                with torch.no_grad():
                    return model(suffix, past_key_values=cache_from_layers(keys, values)).logits[0, -1]

            read_s, compute_s, serial, layerwise, ahead_s = [], [], [], [], []
            for i in range(args.repeats + 1):
                t0 = time.perf_counter()
                await client.get(hit, into=HFLayersKV(keys, values, layout))
                t1 = time.perf_counter()
                logits = compute()
                t2 = time.perf_counter()
                if reference is None:
                    reference = logits
                if i:
                    read_s.append(t1 - t0)
                    serial.append(t2 - t0)
                    t3 = time.perf_counter()
                    compute()
                    compute_s.append(time.perf_counter() - t3)
                bar.update(1)
            client.record_load(h * layout.bytes_per_token, _median(read_s))
            per_token = _median(compute_s) / suffix.shape[1]
            ahead = client.suggest_ahead(h, suffix.shape[1], compute_s_per_token=per_token)
            for mode, times, k in (("layerwise", layerwise, 0), ("layerwise-ahead", ahead_s, ahead)):
                for i in range(args.repeats + 1):
                    for t in keys + values:
                        t.zero_()
                    t0 = time.perf_counter()
                    load = client.load(hit, into=HFLayersKV(keys, values, layout), ahead=k, deadline_s=60)
                    with torch.no_grad(), wait_per_layer(model, load):
                        load.wait(0)
                        logits = model(suffix, past_key_values=cache_from_layers(keys, values)).logits[0, -1]
                    elapsed = time.perf_counter() - t0
                    await load.finished()
                    assert reference is not None and torch.equal(logits, reference), f"{mode} changed the logits"
                    if i:
                        times.append(elapsed)
                    bar.update(1)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    t_read, t_compute = _median(read_s), _median(compute_s)
    ideal = max(t_read, t_compute)
    results = [
        {"mode": mode, "seconds": round(_median(ts), 4), "ideal_seconds": round(ideal, 4), "ratio": round(_median(ts) / ideal, 3)}
        for mode, ts in (("serial", serial), ("layerwise", layerwise), ("layerwise-ahead", ahead_s))
    ]
    return {"hit_tokens": h, "new_tokens": int(suffix.shape[1]), "layers": layout.num_layers, "ahead": ahead,
            "t_read_s": round(t_read, 4), "t_compute_s": round(t_compute, 4),
            "hit_bytes": h * layout.bytes_per_token, "results": results}


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tqdm(total=3 * (args.repeats + 1), desc="overlap", unit="run", disable=None) as bar:
        return asyncio.run(_measure(args, bar))


def print_table(report: dict[str, Any]) -> None:
    print(f"hit {report['hit_tokens']} tokens ({report['hit_bytes'] / 2**20:.0f} MiB), {report['new_tokens']} new tokens, "
          f"{report['layers']} layers; T_read {report['t_read_s'] * 1e3:.1f} ms, T_compute {report['t_compute_s'] * 1e3:.1f} ms, "
          f"ahead={report['ahead']}")
    print(f"{'mode':<16} {'ms':>8} {'ideal ms':>9} {'ratio':>6}")
    for r in report["results"]:
        print(f"{r['mode']:<16} {r['seconds'] * 1e3:>8.1f} {r['ideal_seconds'] * 1e3:>9.1f} {r['ratio']:>6.2f}")
