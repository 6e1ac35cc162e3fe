"""kvstore-bench pd: disaggregated prefill through kvstore on real vLLM engines, against the
chapter's transfer model (DESIGN §12.7: handoff time = bytes / link bandwidth + a fixed
cost).

More: bench/pd/README.md (### pd_bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvstore.bench.common.cluster_procs import Etcd, start_nodes
from kvstore.bench.common.harness import stop_process
from kvstore.bench.common.proc_stat import cpu_seconds
from kvstore.bench.pd import pd_report
from kvstore.bench.pd.pd_link import Link

ARMS = ("colocated", "pool", "direct")
QUIET_CORES, QUIET_WINDOW_S, QUIET_MAX_S = 0.05, 0.2, 10.0  # Bench.quiesce: the nodes idle before each request


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="512,2048,8192", help="prompt lengths handed off (comma-separated; multiples of --block-size)")
    p.add_argument("--repeats", type=int, default=3, help="prompts per length and arm (medians reported)")
    p.add_argument("--fixed-repeats", type=int, default=7, help="one-page handoffs for the model's fixed cost")
    p.add_argument("--layers", type=int, default=4, help="of the random-weight Llama (bytes per token follow from these)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads (attention heads: max(this, hidden / head dim))")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension")
    p.add_argument("--block-size", type=int, default=128, help="vLLM block = kvstore page (tokens)")
    p.add_argument("--chunk-tokens", type=int, default=0,
                   help="vLLM's max_num_batched_tokens: a longer prompt's prefill runs in chunks of this many tokens, and a "
                        "direct handoff pushes the chunks before the last while it computes (0: the whole prompt in one step)")
    p.add_argument("--push-layers", default="auto", choices=("auto", "on", "off"),
                   help="the connector's handoff_push_layers: a prefill's layers go while later ones compute (DESIGN §12.7); "
                        "auto: only where vLLM's KV is on an accelerator (off here, a CPU engine)")
    p.add_argument("--data-plane", default="tcp", choices=("tcp", "ucx", "grpc"), help="between the two nodes")
    p.add_argument("--pump-rounds", type=int, default=5,
                   help="rounds of the raw TCP pump at the start (median; each direct handoff also gets one just before it)")
    p.add_argument("--host-capacity", default="1GiB", help="each node's host tier (an arena touched at start: keep it small)")
    p.add_argument("--dir", default="bench-out/pd")
    p.add_argument("--plot", default="bench-out/pd.png", help="PNG of handoff time vs bytes with the model line ('' for none)")


class Engine:
    """A ``pd_engine.py`` child, importing vLLM from the start; ``start`` gives it its model and
    config, ``call`` sends one command and reads its answer."""

    def __init__(self, log: Path) -> None:
        self._log = open(log, "w")  # noqa: SIM115 - open for the child's life, closed in close()
        self.log_path = log
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.bench.pd.pd_engine"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)

    def start(self, model: Path, config: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"model": str(model), "config": config}) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"engine exited ({self.proc.poll()}); log tail:\n{tail}")
        return json.loads(line)

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def exit(self) -> None:
        """Asks the child to end, without waiting (``close`` waits): the engines end side by side,
        each taking seconds to shut vLLM down."""
        if self.proc.poll() is None and self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.close()
            except OSError:  # it exited meanwhile
                pass

    def close(self) -> None:
        self.exit()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            stop_process(self.proc, 5)
        self._log.close()


def _model(path: Path, args: argparse.Namespace, max_len: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(args.kv_heads, args.hidden // args.head_dim)
    config = LlamaConfig(vocab_size=2048, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=args.kv_heads,
                         head_dim=args.head_dim, max_position_embeddings=max_len, tie_word_embeddings=False,
                         initializer_range=0.2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(path)
    return path


class Bench:
    """The running processes and one measurement per call."""

    def __init__(self, args: argparse.Namespace, engines: dict[str, Engine], pids: dict[str, list[int]]) -> None:
        self.args = args
        self.engines = engines
        self.pids = pids
        self.bytes_per_token = args.layers * 2 * args.kv_heads * args.head_dim * 4
        self.rng = random.Random(7)

    def prompt(self, tokens: int) -> list[int]:
        return [self.rng.randrange(1, 2048) for _ in range(tokens)]

    def cpu(self) -> dict[str, float]:
        return {group: sum(cpu_seconds(pid) or 0.0 for pid in pids) for group, pids in self.pids.items()}

    def quiesce(self) -> None:
        """Waits until the nodes are idle (under QUIET_CORES of CPU over QUIET_WINDOW_S, at most
        QUIET_MAX_S): what the previous request left them (its pages demoted to the SSD tier, a
        handoff's slots given back) would otherwise run during the next request's prefill, on the
        same two cores, and land in whichever arm comes next."""
        deadline = time.monotonic() + QUIET_MAX_S
        before = self.cpu()["nodes"]
        while time.monotonic() < deadline:
            time.sleep(QUIET_WINDOW_S)
            now = self.cpu()["nodes"]
            if now - before < QUIET_CORES * QUIET_WINDOW_S:
                return
            before = now

    def colocated(self, tokens: int) -> dict[str, Any]:
        self.quiesce()
        prompt = self.prompt(tokens)
        out = self.engines["decode"].call(cmd="generate", prompts=[prompt], max_tokens=2)
        self.engines["decode"].call(cmd="settle")
        got = out["outputs"][0]
        if got["num_cached_tokens"]:
            raise RuntimeError(f"the colocated prompt found {got['num_cached_tokens']} tokens cached; it must compute all")
        first, second = got["token_times"]
        return {"ttft_s": first - out["start"], "second_s": second - out["start"]}

    def handoff(self, tokens: int, direct: bool) -> dict[str, Any]:
        """One PD request; its TTFT, handoff time and CPU (see the module docstring)."""
        prefill, decode = self.engines["prefill"], self.engines["decode"]
        self.quiesce()
        prompt = self.prompt(tokens)
        ask = {"do_remote_decode": True, "do_remote_prefill": False, "kvstore_decode_node": "nd" if direct else None}
        cpu0 = self.cpu()
        first = prefill.call(cmd="generate", prompts=[prompt], max_tokens=1, kv_transfer_params=[ask])
        params = dict(first["outputs"][0]["kv_transfer_params"] or {})
        params.pop("remote_prefill_cached_tokens", None)  # the prefill's own hits (none): not the decode's
        token = first["outputs"][0]["tokens"]  # what kvstore-pd-proxy streams at once, then the decode continues from
        second = decode.call(cmd="generate", prompts=[prompt + token], max_tokens=1, kv_transfer_params=[params])
        sent, received = prefill.call(cmd="settle"), decode.call(cmd="settle")
        cpu1 = self.cpu()
        handoff_id, page = params.get("kvstore_handoff_id"), self.args.block_size
        waits = [w for w in received["waits"] if w[0] == handoff_id]
        completes = [c for c in sent["completes"] if c[0] == handoff_id]
        fetches = [f for f in received["fetch_ends"] if f[0] == handoff_id]
        if not (handoff_id and sent["save_ends"] and waits and completes and fetches):
            raise RuntimeError(f"handoff {handoff_id} left no trace: {params}, {sent}, {received}")
        handed = int(params["kvstore_num_tokens"])
        got = second["outputs"][0]
        if handed != tokens or waits[0][3] * page < handed:
            raise RuntimeError(f"{handed} tokens handed, {waits[0][3]} pages at the decode node, of {tokens}")
        if got["num_cached_tokens"] != handed:
            raise RuntimeError(f"the decode side reports {got['num_cached_tokens']} cached tokens, not the {handed} handed off")
        stored = max(t for t, _ in sent["save_ends"])
        wait_start, wait_end = waits[0][1], waits[0][2]
        return {"ttft_s": first["outputs"][0]["token_times"][0] - first["start"],
                "second_s": got["token_times"][0] - first["start"], "handoff_s": wait_end - stored, "bytes": handed * self.bytes_per_token,
                "prefill_s": first["end"] - first["start"], "stored_after_prefill_s": stored - first["end"],
                "complete_start_s": completes[0][1] - stored, "complete_end_s": completes[0][2] - stored,
                "wait_start_s": wait_start - stored, "get_s": fetches[0][1] - wait_end,
                "decode_after_get_s": got["token_times"][0] - fetches[0][1], "num_cached_tokens": got["num_cached_tokens"],
                "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0}}


def _direct(bench: Bench, link: Link, tokens: int) -> dict[str, Any]:
    """A direct handoff, with the raw link's round run just before it (``link_gbps``)."""
    gbps = link.round()
    return bench.handoff(tokens, True) | {"link_gbps": gbps}


def _measure(bench: Bench, link: Link, lengths: list[int], bar: tqdm) -> dict[str, Any]:
    args = bench.args
    for direct in (False, True):  # warm-up: both paths once
        bench.handoff(2 * args.block_size, direct)
    for tokens in lengths:  # and each length on both engines: a first prompt of a new length runs slower (allocations)
        bench.handoff(tokens, True)
        bench.colocated(tokens)
    bar.update(1)
    fixed = []
    for _ in range(args.fixed_repeats):
        fixed.append(_direct(bench, link, args.block_size))
        bar.update(1)
    samples: dict[int, dict[str, list[dict[str, Any]]]] = {t: {arm: [] for arm in ARMS} for t in lengths}
    for repeat in range(args.repeats):
        for tokens in lengths:
            order = ARMS[repeat % 3:] + ARMS[: repeat % 3]  # the arms take turns going first
            for arm in order:
                samples[tokens][arm].append(bench.colocated(tokens) if arm == "colocated" else
                                            _direct(bench, link, tokens) if arm == "direct" else bench.handoff(tokens, False))
            bar.update(1)
    return {"fixed": fixed, "samples": samples}


def run(args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in str(args.tokens).split(",")]
    if any(t <= 0 or t % args.block_size for t in lengths):
        raise SystemExit(f"--tokens must be positive multiples of --block-size ({args.block_size}), got {args.tokens}")
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    max_len = (max(lengths) + 1 + 64 + args.block_size - 1) // args.block_size * args.block_size
    etcd: Etcd | None = None
    engines: dict[str, Engine] = {}
    nodes = []
    link: Link | None = None
    try:
        # the engines first: each imports vLLM (most of its start) while the model is made and the nodes start
        for role in ("prefill", "decode"):
            engines[role] = Engine(workdir / f"{role}.log")
        model = _model(workdir / "model", args, max_len)
        etcd = Etcd(workdir)
        nodes = start_nodes(workdir, etcd, "pd", ["np", "nd"], args.data_plane, 10, args.host_capacity)
        extra = {"load_when_faster": False, "load_deadline_s": 30, "lookup_timeout_s": 5, "handoff_deadline_s": 30,
                 "handoff_ttl_s": 60, "handoff_push_layers": {"on": True, "off": False}.get(args.push_layers, "auto")}
        for role, node in (("prefill", nodes[0]), ("decode", nodes[1])):
            engines[role].start(model, {"extra": {"address": node.address, **extra}, "block_size": args.block_size,
                                        "max_model_len": max_len, "max_num_batched_tokens": args.chunk_tokens or max_len})
        for engine in engines.values():
            if not engine.read().get("ready"):
                raise RuntimeError("an engine did not start")
        pids = {"nodes": [n.proc.pid for n in nodes if n.proc is not None], "engines": [e.proc.pid for e in engines.values()]}
        bench = Bench(args, engines, pids)
        page_bytes = args.block_size * bench.bytes_per_token
        link = Link(page_bytes, max(64 << 20, max(lengths) * bench.bytes_per_token))
        at_start = link.measure(args.pump_rounds)
        total = 1 + args.fixed_repeats + args.repeats * len(lengths)
        with tqdm(total=total, desc="pd", unit="step", disable=None) as bar:
            measured = _measure(bench, link, lengths, bar)
    finally:
        if link is not None:
            link.close()
        for engine in engines.values():
            engine.exit()
        for engine in engines.values():
            engine.close()
        for node in nodes:
            node.stop()
        if etcd is not None:
            etcd.stop()
    report = pd_report.summarize(args, lengths, bench.bytes_per_token, at_start, measured)
    report["load_average_1m"] = round(os.getloadavg()[0], 2)
    if args.plot:
        pd_report.plot(report, args.plot)
        report["plot"] = args.plot
    shutil.rmtree(workdir / "model", ignore_errors=True)
    return report


def print_table(report: dict[str, Any]) -> None:
    pd_report.print_table(report)
