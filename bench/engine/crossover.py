"""kvstore-bench crossover: when does fetching stored KV beat recomputing it, here?

More: bench/engine/README.md (### crossover.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import grpc
import torch
from tqdm import tqdm

from kvstore import KVLayout, Namespace, cost_model, planner
from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.bench.common.harness import start_server
from kvstore.bench.common.linkproxy import LinkProxy
from kvstore.client import KVStoreClient

PATHS = ("host-shm", "host-grpc", "ssd")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="256,512,1024,2048", help="prefix lengths (tokens); each read is predicted from the earlier ones of its path")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--link-mbps", default="2,5,10,20,50", help="emulated link bandwidths to sweep, MB/s")
    p.add_argument("--repeats", type=int, default=2, help="prefills per length (the best counts)")
    p.add_argument("--read-repeats", type=int, default=5, help="writes and reads per path and length")
    p.add_argument("--plot", default="bench-out/crossover.png")
    p.add_argument("--dir", default="bench-out/crossover")


def _model(args: argparse.Namespace, max_len: int) -> tuple[Any, Any]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=2048, hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
        num_attention_heads=max(args.kv_heads, args.hidden // args.head_dim), num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=max_len + 16, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval(), config


def _poisoned_like(kv: torch.Tensor) -> torch.Tensor:
    """A fresh destination full of a byte pattern no read leaves there by chance."""
    into = torch.empty_like(kv)
    into.view(torch.uint8).fill_(0xA5)
    return into


async def _read_checked(path: str, client: KVStoreClient, hit: Any, kv: torch.Tensor) -> float:
    """Seconds to read ``hit`` into a fresh poisoned buffer, which must then equal ``kv`` bit
    for bit. Fresh per read: a buffer an earlier path had filled would hide a path that
    wrote nothing or too little."""
    into = _poisoned_like(kv)
    t0 = time.perf_counter()
    await client.get(hit, into=into)
    seconds = time.perf_counter() - t0
    if not torch.equal(into.view(torch.uint8), kv.view(torch.uint8)):
        raise RuntimeError(f"{path}: the read returned other bytes than were stored")
    return seconds


def _best(xs: list[float]) -> float:
    """Best of the repeats: the least disturbed run on a shared machine."""
    return min(xs)


async def _measure(args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    lengths = sorted(int(x) for x in args.lengths.split(","))
    model, config = _model(args, lengths[-1])
    layout = KVLayout.from_hf_config(config, dtype=torch.float32, page_tokens=16)
    ns = Namespace(model="bench-crossover", revision="r", layout=layout)
    ids = torch.randint(0, 2048, (1, lengths[-1]), generator=torch.Generator().manual_seed(3))
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    total = lengths[-1] * layout.bytes_per_token
    server, addr = start_server(workdir, 4 * total + (64 << 20), 4 * total + (256 << 20), "--ssd-dwpd", "0", "--ssd-admission", "all")
    rows: dict[int, dict[str, float]] = {}
    # one online model per path, as the connector keeps one per client (shared memory: host-shm and ssd)
    models = {path: cost_model.LinearCost(cost_model.fetch_prior(path != "host-grpc"), restart_factor=cost_model.FETCH_RESTART_FACTOR)
              for path in PATHS}
    recompute = cost_model.LinearCost(cost_model.recompute_prior(3000.0))  # tokens -> seconds of a prefill
    try:
        async with grpc.aio.insecure_channel(addr) as ch, KVStoreClient(addr, ns) as shm, KVStoreClient(addr, ns, use_shm=False) as wire:
            directory = directory_pb2_grpc.DirectoryStub(ch)

            async def clear() -> None:
                await directory.Invalidate(directory_pb2.InvalidateRequest(namespace_id=ns.namespace_id))

            for n in lengths:
                row: dict[str, float] = {}
                prefix = ids[:, :n]
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        out = model(prefix, use_cache=True)
                    times.append(time.perf_counter() - t0)
                row["recompute"] = _best(times)
                # what the connector decides with (tokens x the fitted slope: LoadCosts.recompute_s),
                # from the shorter prefixes' prefills only; every prefill is fed, as a connector sees each step
                row["recompute-extrapolated"] = n * recompute.line().per_unit_s
                for t in times:
                    recompute.observe(n, t)
                kv = torch.stack([torch.stack([layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)])
                                  for layer in out.past_key_values.layers]).contiguous()
                tokens = prefix[0].tolist()
                row["bytes"] = n * layout.bytes_per_token
                for path, client, durable in (("host-shm", shm, False), ("host-grpc", wire, False), ("ssd", shm, True)):
                    w, r, predicted = [], [], []
                    for _ in range(args.read_repeats):
                        await clear()
                        t0 = time.perf_counter()
                        await client.put(tokens, kv, durable=durable)
                        w.append(time.perf_counter() - t0)
                        hit = await client.lookup(tokens)
                        if path == "ssd":
                            await directory.Remove(directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=hit.keys, tier="host"))
                        # predicted from this path's earlier reads only (the first of the longest
                        # prefix: from the shorter prefixes' reads only), then measured and fed in
                        predicted.append(models[path].seconds(row["bytes"]))
                        r.append(await _read_checked(path, client, hit, kv))
                        models[path].observe(row["bytes"], r[-1])
                    row[f"{path}-write"], row[f"{path}-read"] = _best(w), _best(r)
                    # the first read of a length is predicted from the shorter ones (extrapolated), the
                    # others from this length's earlier reads too (what the connector does for a size it has seen)
                    row[f"{path}-extrapolated"], seen = predicted[0], predicted[1:] or predicted
                    row[f"{path}-read-median"], row[f"{path}-predicted"] = statistics.median(r[-len(seen):]), statistics.median(seen)
                    row[f"{path}-read-error"] = statistics.median(abs(p / m - 1) for p, m in zip(seen, r[-len(seen):]))
                rows[n] = row
                bar.update(1)
            # the emulated link, at the longest prefix
            n = lengths[-1]
            await clear()
            kv_tokens = ids[0, :n].tolist()
            with torch.no_grad():
                out = model(ids[:, :n], use_cache=True)
            kv = torch.stack([torch.stack([layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)])
                              for layer in out.past_key_values.layers]).contiguous()
            await shm.put(kv_tokens, kv)
            emulated = []
            for mbps in [float(x) for x in args.link_mbps.split(",")]:
                proxy = LinkProxy(addr, mbps * 1e6)
                try:
                    async with KVStoreClient(proxy.address, ns, use_shm=False, timeout_s=600) as remote:
                        t0 = time.perf_counter()
                        hit = await remote.lookup(kv_tokens)
                        fetch = time.perf_counter() - t0 + await _read_checked(f"link {mbps:g} MB/s", remote, hit, kv)
                finally:
                    proxy.close()
                emulated.append({"link_gbps": mbps / 1e3, "fetch_ms": round(fetch * 1e3, 1)})
                bar.update(1)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return _report(args, layout, lengths, rows, emulated, models["host-grpc"].seconds(total),
                   lengths[-1] * recompute.line().per_unit_s)


def _report(args: argparse.Namespace, layout: KVLayout, lengths: list[int], rows: dict[int, dict[str, float]],
            emulated: list[dict[str, Any]], wire_s: float, recompute_s: float) -> dict[str, Any]:
    """``wire_s``: the gRPC path's model's read of the longest prefix once every gRPC read
    was fed to it: an emulated link adds V/B to it. ``recompute_s``: what the connector's
    model says recomputing the longest prefix costs once every prefill was fed to it (the
    quantity it decides with: tokens x slope), as a connector that has seen that length."""
    target = lengths[-1]
    v = rows[target]["bytes"]
    t_rec = rows[target]["recompute"]
    r_measured = planner.production_rate(v, t_rec)
    paths = []
    for path in PATHS:
        row = rows[target]
        read, write, median = row[f"{path}-read"], row[f"{path}-write"], row[f"{path}-read-median"]
        paths.append({
            "path": path, "read_gbps": round(v / read / 1e9, 4), "write_gbps": round(v / write / 1e9, 4),
            "reuses_to_win": planner.reuses_to_win(write, read, t_rec),
            # medians over the repeats after the first: each read predicted from this path's earlier reads
            "predicted_read_ms": round(row[f"{path}-predicted"] * 1e3, 2), "measured_read_ms": round(median * 1e3, 2),
            "prediction_error": round(row[f"{path}-predicted"] / median - 1, 3),
            "per_read_error": round(row[f"{path}-read-error"], 3),  # median of |predicted / measured - 1| per read
            # the first read of this length, predicted from the shorter prefixes' reads only
            "extrapolated_read_ms": round(row[f"{path}-extrapolated"] * 1e3, 2),
            "extrapolation_error": round(row[f"{path}-extrapolated"] / median - 1, 3),
        })
    predicted_rec, extrapolated_rec = recompute_s, rows[target]["recompute-extrapolated"]
    wire_fixed = wire_s  # the emulated link adds V/B to what the same gRPC read costs without it
    for e in emulated:
        link = e["link_gbps"] * 1e9
        e["recompute_ms"] = round(t_rec * 1e3, 1)
        e["fetch_wins"] = e["fetch_ms"] < e["recompute_ms"]
        e["predicted_fetch_ms"] = round((wire_fixed + v / link) * 1e3, 1)
    # measured crossover: where fetch time meets recompute time (log-linear interpolation)
    measured_x = None
    for a, b in itertools.pairwise(emulated):
        if (a["fetch_ms"] - a["recompute_ms"]) * (b["fetch_ms"] - b["recompute_ms"]) <= 0:
            la, lb = math.log(a["link_gbps"]), math.log(b["link_gbps"])
            fa, fb = math.log(a["fetch_ms"]), math.log(b["fetch_ms"])
            target_f = math.log(a["recompute_ms"])
            measured_x = math.exp(la + (target_f - fa) * (lb - la) / (fb - fa)) if fb != fa else math.exp(la)
            break
    predicted_x = planner.tie_bandwidth(v, predicted_rec, wire_fixed) / 1e9
    extrapolated_x = planner.tie_bandwidth(v, extrapolated_rec, wire_fixed) / 1e9
    return {
        "model": {"layers": args.layers, "hidden": args.hidden, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "bytes_per_token": layout.bytes_per_token},
        "prefix_tokens": target, "prefix_bytes": v,
        "recompute_ms": round(t_rec * 1e3, 1), "predicted_recompute_ms": round(predicted_rec * 1e3, 1),
        "recompute_prediction_error": round(predicted_rec / t_rec - 1, 3),
        "extrapolated_recompute_ms": round(extrapolated_rec * 1e3, 1),  # from the shorter prefixes only
        "r_gbps": round(r_measured / 1e9, 6), "paths": paths, "emulated": emulated,
        "crossover_link_gbps": {"measured": None if measured_x is None else round(measured_x, 6),
                                "predicted": round(predicted_x, 6), "extrapolated": round(extrapolated_x, 6),
                                "error": None if measured_x is None else round(predicted_x / measured_x - 1, 3),
                                "r": round(r_measured / 1e9, 6)},
        "by_length": {str(n): {k: (x if k == "bytes" else round(x, 3) if k.endswith("error") else round(x * 1e3, 2))
                               for k, x in rows[n].items()} for n in lengths},
        "chapter": chapter_choices(),
    }


def chapter_choices() -> dict[str, Any]:
    """The same planner fed the chapter's A100/H20 numbers (DESIGN §10)."""
    v = 8192 * planner.kv_bytes_per_token_gqa(36, 8, 128, 2)
    rec = 0.856
    paths = {"host RAM (PCIe 25 GB/s)": (v / 25e9, v / 25e9), "local SSD (7.1/4.2 GB/s)": (v / 4.2e9, v / 7.1e9),
             "remote pool (25 GB/s)": (v / 25e9, v / 25e9), "10 GbE (1.25 GB/s)": (v / 1.25e9, v / 1.25e9)}
    out: dict[str, Any] = {"r_gbps": round(planner.production_rate(v, rec) / 1e9, 3), "paths": {}}
    for name, (w, r) in paths.items():
        out["paths"][name] = {"read_ms": round(r * 1e3, 1), "reuses_to_win": planner.reuses_to_win(w, r, rec)}
    pf = planner.PrefillModel(points=((256, 0.0309), (8448, 0.887)))
    req = planner.Request(8448, v / 8192)
    for gbe, bps in (("50GbE", 6.25e9), ("200GbE", 25e9)):
        plan = planner.route(req, [planner.Candidate("A", 0.250, pf, hbm_tokens=8192),
                                   planner.Candidate("B", 0.020, pf, remote_tokens=8192, network_bps=bps, lookup_s=0.010)])
        out[f"route_{gbe}"] = f"{plan.best.candidate}/{plan.best.path} in {plan.best.first_token_s * 1e3:.0f} ms"
    return out


def _plot(report: dict[str, Any], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    lengths = sorted(int(n) for n in report["by_length"])
    by = report["by_length"]
    ax1.plot(lengths, [by[str(n)]["recompute"] for n in lengths], "k-o", label="recompute (prefill)")
    for p in ("host-shm", "host-grpc", "ssd"):
        ax1.plot(lengths, [by[str(n)][f"{p}-read"] for n in lengths], "-o", label=f"fetch {p}")
    bpt = report["model"]["bytes_per_token"]
    for e in report["emulated"]:
        ax1.plot(lengths, [n * bpt / (e["link_gbps"] * 1e9) * 1e3 for n in lengths], ":", alpha=0.6,
                 label=f"link {e['link_gbps'] * 1e3:g} MB/s (V/B)")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("prefix length (tokens)")
    ax1.set_ylabel("time (ms)")
    ax1.set_title("fetch vs recompute by prefix length")
    ax1.legend(fontsize=7)
    ax1.grid(True, alpha=0.3)
    links = [e["link_gbps"] * 1e3 for e in report["emulated"]]
    ax2.plot(links, [e["fetch_ms"] for e in report["emulated"]], "b-o", label="fetch over emulated link (measured)")
    ax2.plot(links, [e["predicted_fetch_ms"] for e in report["emulated"]], "b--", label="fetch (planner)")
    ax2.axhline(report["recompute_ms"], color="k", label="recompute (measured)")
    cx = report["crossover_link_gbps"]
    if cx["measured"]:
        ax2.axvline(cx["measured"] * 1e3, color="g", label=f"crossover measured {cx['measured'] * 1e3:.1f} MB/s")
    ax2.axvline(cx["predicted"] * 1e3, color="r", linestyle="--", label=f"crossover planner {cx['predicted'] * 1e3:.1f} MB/s")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("link bandwidth (MB/s)")
    ax2.set_ylabel("time (ms)")
    ax2.set_title(f"{report['prefix_tokens']}-token prefix: fetch vs recompute")
    ax2.legend(fontsize=7)
    ax2.grid(True, alpha=0.3)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> dict[str, Any]:
    steps = len(args.lengths.split(",")) + len(args.link_mbps.split(","))
    with tqdm(total=steps, desc="crossover", unit="step", disable=None) as bar:
        report = asyncio.run(_measure(args, bar))
    if args.plot:
        report["plot"] = _plot(report, args.plot)
    return report


def print_table(report: dict[str, Any]) -> None:
    print(f"prefix {report['prefix_tokens']} tokens = {report['prefix_bytes'] / 2**20:.1f} MiB; recompute "
          f"{report['recompute_ms']:.0f} ms (cost model, tokens x slope as the connector decides: "
          f"{report['predicted_recompute_ms']:.0f}, {100 * report['recompute_prediction_error']:+.0f}%; "
          f"from the shorter prefixes only: {report['extrapolated_recompute_ms']:.0f}); "
          f"r = {report['r_gbps'] * 1e3:.2f} MB/s")
    print("reads of the longest prefix, each predicted by the online cost model from the path's earlier reads (medians of "
          "the reads after the first; per read: median |error|), and the first from the shorter prefixes' reads only (extrap):")
    print(f"{'path':<10} {'read GB/s':>9} {'write GB/s':>10} {'reuses':>6} {'pred ms':>8} {'meas ms':>8} {'err':>6} "
          f"{'per read':>8} {'extrap ms':>9} {'err':>6}  vs r")
    for p in report["paths"]:
        print(f"{p['path']:<10} {p['read_gbps']:>9.3f} {p['write_gbps']:>10.3f} {p['reuses_to_win']!s:>6} "
              f"{p['predicted_read_ms']:>8.1f} {p['measured_read_ms']:>8.1f} {100 * p['prediction_error']:>5.0f}% "
              f"{100 * p['per_read_error']:>7.0f}% {p['extrapolated_read_ms']:>9.1f} {100 * p['extrapolation_error']:>5.0f}%  "
              f"{p['read_gbps'] / report['r_gbps']:.0f}x r")
    print(f"{'link MB/s':>10} {'fetch ms':>9} {'pred ms':>8} {'recompute':>9} wins")
    for e in report["emulated"]:
        print(f"{e['link_gbps'] * 1e3:>10g} {e['fetch_ms']:>9.0f} {e['predicted_fetch_ms']:>8.0f} {e['recompute_ms']:>9.0f} {e['fetch_wins']}")
    cx = report["crossover_link_gbps"]
    error = "" if cx["error"] is None else f" ({100 * cx['error']:+.0f}%)"
    print(f"crossover: measured {cx['measured'] and cx['measured'] * 1e3} MB/s, cost model {cx['predicted'] * 1e3:.2f} MB/s{error} "
          f"(from the shorter prefixes' prefills only: {cx['extrapolated'] * 1e3:.2f}), r {cx['r'] * 1e3:.2f} MB/s")
    print("chapter (A100/H20 numbers):", report["chapter"])
    if report.get("plot"):
        print(f"plot: {report['plot']}")
