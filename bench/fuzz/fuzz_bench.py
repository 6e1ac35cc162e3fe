"""kvstore-bench fuzz: random and mutated requests on every RPC of a real kvstore-server with
auth and TLS on; the server must stay up, never answer INTERNAL or UNKNOWN, never hang, keep
its memory, and still be exact afterwards.

More: bench/fuzz/README.md (### fuzz_bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from google.protobuf import message_factory
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from kvstore import KVLayout, Namespace
from kvstore._proto import data_pb2, directory_pb2
from kvstore.bench.common.harness import free_port, rss, start_server
from kvstore.bench.common.secure import make_credentials
from kvstore.bench.fuzz import exactness, fuzz_mutate
from kvstore.bench.fuzz.fuzz_calls import (
    BAD_CALLERS,
    CALL_TIMEOUT_S,
    CANCELLED_BY_US,
    CLIENT_SEND_FAILED,
    Case,
    call,
    client_send_failed,
)
from kvstore.bench.fuzz.fuzz_cases import VALID, Pools, learn, write_pages_stream
from kvstore.bench.fuzz.fuzz_socket import SocketFuzzer
from kvstore.bench.fuzz.fuzz_streams import every_method, mutate_stream
from kvstore.client import KVStoreClient
from kvstore.client.arena import ArenaMap
from kvstore.page import LayoutDesc
from kvstore.security.authfile import new_token
from kvstore.security.channel import aio_channel, call_metadata
from kvstore.validate import layout_msg

HUGE_BYTES = 1 << 20  # requests this large go one at a time (see Fuzzer.run_case)
OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]


@dataclass
class Tally:
    calls: Counter[str] = field(default_factory=Counter)
    messages: Counter[str] = field(default_factory=Counter)
    codes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    strategies: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)  # INTERNAL/UNKNOWN/hang answers with their request


class Fuzzer:
    """Makes the calls: picks an RPC and a caller, builds the case, calls, tallies the
    answer and learns from it (handles, stored pages) for the cases that follow."""

    def __init__(self, addr: str, tenants: list[Pools], admin: str, tls: Any, arena: ArenaMap | None, seed: int,
                 only: set[str] | None = None) -> None:
        self.rng = random.Random(seed)
        self.tenants, self.admin, self.arena = tenants, admin, arena
        self.channel = aio_channel(addr, OPTIONS, tls=tls, per_call_tokens=True)  # tokens go per call, as metadata: callers vary
        self.every = list(every_method())
        self.methods = [m for m in self.every if not only or m[1].name in only]
        self.tally = Tally()
        # One huge request at a time: the server's heaps keep their high-water marks (see
        # tests/server/test_fuzz_findings.py), which several huge requests landing together
        # would raise for good without any leak.
        self._huge = asyncio.Lock()

    def _caller(self) -> tuple[str, Pools, str | None, tuple[tuple[str, str], ...]]:
        pools = self.rng.choice(self.tenants)
        roll = self.rng.random()
        if roll < 0.72:
            return pools.tenant, pools, pools.token, call_metadata(pools.token)
        if roll < 0.82:
            return "admin", pools, self.admin, call_metadata(self.admin)
        if roll < 0.88:
            return "none", pools, None, ()
        if roll < 0.94:
            return "wrong-token", pools, None, call_metadata(new_token())
        bad = self.rng.choice((
            ("authorization", "Bearer"), ("authorization", "Basic dXNlcjpwYXNzd29yZA=="), ("authorization", f"Bearer {pools.token[:-1]}"),
            ("authorization", "Bearer " + "A" * 4000), ("authorization", pools.token), ("x-api-key", pools.token)))
        return "malformed", pools, None, (bad,)

    def next_case(self, among: list[tuple[Any, Any]] | None = None) -> Case:
        """A case of one of ``among`` (default: the run's methods)."""
        method = self.rng.choice(among or self.methods)[1]
        caller, pools, token, metadata = self._caller()
        request_type = message_factory.GetMessageClass(method.input_type)
        build = VALID.get(method.name)
        case = Case(method, caller, pools, token, metadata, "valid", [])
        if method.client_streaming:
            if method.name == "WritePages":
                chunks, case.page_keys = write_pages_stream(pools, self.rng)
            else:
                chunks = [fuzz_mutate.fill(request_type(), pools, self.rng).SerializeToString() for _ in range(self.rng.randint(1, 3))]
            case.requests, case.strategy, case.cancel_after = mutate_stream(chunks, request_type, pools, self.rng)
            return case
        message = build(pools, self.rng, self.arena) if build is not None else fuzz_mutate.fill(request_type(), pools, self.rng)
        roll = self.rng.random()
        if roll < 0.25:
            case.strategy = "valid" if build is not None else "typed-random"
        elif roll < 0.7:
            case.strategy = "fields: " + ", ".join(fuzz_mutate.mutate(message, pools, self.rng))
        elif roll < 0.9:
            raw, op = fuzz_mutate.mutate_encoding(message.SerializeToString(), self.rng)
            case.requests, case.strategy = [raw], f"encoding: {op}"
            return case
        else:
            case.requests, case.strategy = [fuzz_mutate.random_bytes(self.rng)], "random bytes"
            return case
        case.request, case.requests = message, [message.SerializeToString()]
        return case

    async def run_case(self, case: Case) -> None:
        name = case.method.name
        self.tally.calls[name] += 1
        self.tally.messages[name] += len(case.requests)
        self.tally.strategies[case.strategy.split(":")[0]] += 1
        try:
            if sum(map(len, case.requests)) >= HUGE_BYTES:
                async with self._huge:
                    response = await call(self.channel, case)
            else:
                response = await call(self.channel, case)
            code = "OK" if response is not None else CANCELLED_BY_US
        except grpc.aio.AioRpcError as exc:
            response, code = None, exc.code().name
            if client_send_failed(exc, case):
                code = CLIENT_SEND_FAILED
            elif exc.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) or (
                    exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not case.method.server_streaming):
                self._fault(case, code, exc.details() or "")
        self.tally.codes[name][code] += 1
        if case.caller in BAD_CALLERS and code not in ("UNAUTHENTICATED", CANCELLED_BY_US, CLIENT_SEND_FAILED):
            self.tally.violations.append(f"{name}: caller with {case.caller} answered {code}, not UNAUTHENTICATED")
        if response is not None and case.caller not in BAD_CALLERS:
            out_type = message_factory.GetMessageClass(case.method.output_type)
            try:
                parsed = out_type.FromString(response) if isinstance(response, bytes) else response
            except Exception:  # noqa: BLE001 - ReadPages answers hand-encoded chunks; nothing to learn there
                return
            learn(case.pools, name, case.request, parsed, case.token or "", case.page_keys)

    def _fault(self, case: Case, code: str, details: str) -> None:
        raw = b"".join(case.requests)
        self.tally.faults.append({"method": case.method.name, "code": code, "details": details[:300], "caller": case.caller,
                                  "strategy": case.strategy, "request_bytes": len(raw), "request_head_hex": raw[:128].hex()})
        self.tally.violations.append(f"{case.method.name}: {code} ({details[:120]}) for {case.strategy} from {case.caller}")

    async def release_all(self) -> None:
        """Gives back every lease and allocation the run was handed, with the token that got it."""
        data = self.channel.unary_unary("/kvstore.v1.Data/Release")
        abort = self.channel.unary_unary("/kvstore.v1.Data/Abort")
        for pools in self.tenants:
            for lease_id, token in list(pools.leases.items()):
                await _quiet(data(data_pb2.ReleaseRequest(lease_id=lease_id).SerializeToString(), metadata=call_metadata(token)))
            for ident, alloc in list(pools.allocations.items()):
                await _quiet(abort(data_pb2.AbortRequest(allocation_id=ident).SerializeToString(), metadata=call_metadata(alloc.token)))
            pools.leases.clear()
            pools.allocations.clear()

    async def num_leases(self) -> int:
        raw = await self.channel.unary_unary("/kvstore.v1.Directory/Stats")(
            directory_pb2.StatsRequest().SerializeToString(), metadata=call_metadata(self.admin), timeout=CALL_TIMEOUT_S)
        return directory_pb2.StatsResponse.FromString(raw).num_leases


async def _quiet(pending: Any) -> None:
    try:
        await pending
    except grpc.aio.AioRpcError:
        pass  # expired or released already: what matters is the lease count after


def server_error_codes(metrics_port: int) -> dict[str, dict[str, int]]:
    """The server's own count of error answers, method -> code -> calls (its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    codes: dict[str, dict[str, int]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvstore_rpc_errors_total":
                codes[sample.labels["method"]][sample.labels["code"]] = int(sample.value)
    return dict(codes)


async def _seed(addr: str, creds: Any, layouts: list[Any]) -> list[Pools]:
    """Each tenant stores some pages and a session through the real client: the fuzzer starts
    from real namespace ids and keys."""
    tenants = []
    for i, (tenant, tokens) in enumerate(creds.tokens.items()):
        ns = Namespace(model=f"fuzz-{tenant}", revision="r1", layout=layouts[i % len(layouts)])
        async with KVStoreClient(addr, ns, token=tokens[0], tls=creds.tls()) as client:
            tokens_ = list(range(128))
            kv = torch.randn(ns.layout.num_layers, ns.layout.kv_factor, 128, ns.layout.num_kv_heads, ns.layout.head_dim)
            await client.put(tokens_, kv.to(ns.layout.dtype))
            await client.append_tokens("seeded", list(range(10)), expected_length=0, sync=False, prompt_tokens=10)
            desc = LayoutDesc.of(ns.layout)
            pools = Pools(tenant, tokens[0], ns.namespace_id, layout_msg(desc), desc.page_bytes, keys=client.keys(tokens_),
                          sessions={"seeded": 10})
        tenants.append(pools)
    tenants[0].other, tenants[1].other = tenants[1], tenants[0]
    return tenants


async def fuzz(args: argparse.Namespace, bar: Any) -> dict[str, Any]:
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    creds = make_credentials(workdir / "security", {"alice": 1, "bob": 1}, Path(args.tls_dir) if args.tls_dir else None)
    layouts = [KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16),
               KVLayout(num_layers=2, num_kv_heads=1, head_dim=128, dtype=torch.bfloat16, page_tokens=32, attention="mla")]
    metrics_port = free_port()
    server, addr = start_server(workdir, 64 << 20, 256 << 20, "--ssd-dwpd", "0", "--max-remote-records", "20000",
                                "--metrics-listen", f"127.0.0.1:{metrics_port}", *creds.server_args(),
                                "--share-arena",  # the acceptance example's shm path maps the arena with a token
                                env={"MALLOC_ARENA_MAX": str(args.server_malloc_arenas)} if args.server_malloc_arenas else None)
    pid = server.proc.pid
    report: dict[str, Any] = {"calls": args.calls, "seed": args.seed, "server_malloc_arenas": args.server_malloc_arenas,
                              "load_avg_start": os.getloadavg()}
    try:
        tenants = await _seed(addr, creds, layouts)
        async with KVStoreClient(addr, Namespace(model="probe", revision="r", layout=layouts[0]), token=creds.tokens["alice"][0],
                                 tls=creds.tls()) as probe:
            arena = probe.arena  # the fuzzer reads slots to commit them with their real checksums; never writes
            fuzzer = Fuzzer(addr, tenants, creds.admin, creds.tls(), arena, args.seed,
                            set(args.methods.split(",")) if args.methods else None)
            report["rss_start"] = rss(pid)
            warmup = max(1, int(args.calls * args.warmup_share))
            remaining = iter(range(args.calls))

            timeline: list[tuple[int, int]] = []
            report["rss_timeline"] = timeline

            async def worker(stop_at: int) -> None:
                for i in remaining:
                    await fuzzer.run_case(fuzzer.next_case())
                    bar.update(1)
                    if i % max(1, args.calls // 20) == 0 and server.proc.poll() is None:
                        timeline.append((i, rss(pid)["anon"] >> 20))
                    if server.proc.poll() is not None or i + 1 >= stop_at:
                        return

            await asyncio.gather(*(worker(warmup) for _ in range(args.concurrency)))
            report["rss_after_warmup"] = rss(pid)
            await asyncio.gather(*(worker(args.calls) for _ in range(args.concurrency)))
            sockets = SocketFuzzer(probe.calls.blocking.path, fuzzer, args.seed) if probe.calls.blocking is not None else None
            report["socket_methods"] = len(sockets.methods) if sockets else 0  # 0: --methods names none the socket serves
            if sockets and sockets.methods and args.socket_calls:  # the same cases, as frames on the same-host call socket
                await asyncio.to_thread(sockets.run, args.socket_calls, bar, lambda: server.proc.poll() is None)
            report["rss_end"] = rss(pid) if server.proc.poll() is None else None
            alive = server.proc.poll() is None
            if alive:
                await fuzzer.release_all()
                report["leases_after_release"] = await fuzzer.num_leases()
                report["acceptance"] = await exactness.acceptance(addr, creds.tokens["alice"][0], creds.tls())
            await fuzzer.channel.close()
        if server.proc.poll() is None:
            report["server_error_codes"] = server_error_codes(metrics_port)
    finally:
        exit_code = server.proc.poll()
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    report["load_avg_end"] = os.getloadavg()
    return _verdict(report, fuzzer.tally, exit_code)


def _verdict(report: dict[str, Any], tally: Tally, exit_code: int | None) -> dict[str, Any]:
    violations = list(tally.violations)
    report["server_exit_code"] = exit_code  # None: still running at the end
    if exit_code is not None:
        violations.append(f"the server exited during the run (exit code {exit_code})")
    base, end = report.get("rss_after_warmup"), report.get("rss_end")
    if base and end:
        report["rss_growth"] = round(end["rss"] / base["rss"] - 1, 4)
        if report["rss_growth"] >= 0.10:
            violations.append(f"server RSS grew {report['rss_growth']:.1%} after the warm-up (limit 10%)")
    for method, codes in report.get("server_error_codes", {}).items():
        violations += [f"{method}: the server counted {n} {code} answers" for code, n in codes.items() if code in ("INTERNAL", "UNKNOWN")]
    if report.get("leases_after_release"):
        violations.append(f"{report['leases_after_release']} leases left after every lease handed out was released")
    for transport, failed in report.get("acceptance", {}).items():
        violations += [f"acceptance example ({transport}): {f}" for f in failed]
    report["methods"] = {name: {"calls": tally.calls[name], "messages": tally.messages[name], "codes": dict(tally.codes[name])}
                         for name in sorted(tally.calls)}
    report["num_calls"], report["num_messages"] = sum(tally.calls.values()), sum(tally.messages.values())
    report["strategies"] = dict(tally.strategies)
    report["faults"] = tally.faults[:50]
    report["violations"], report["num_violations"] = violations[:50], len(violations)
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--calls", type=int, default=10_000, help="calls to make (a stream's chunks each count as a message)")
    p.add_argument("--concurrency", type=int, default=8, help="calls in flight at once")
    p.add_argument("--socket-calls", type=int, default=2000,
                   help="cases sent afterwards as frames on the same-host call socket (kvstore/callsocket/frames.py)")
    p.add_argument("--warmup-share", type=float, default=0.2, help="share of the calls before the RSS baseline")
    p.add_argument("--seed", type=int, default=0, help="of the cases and mutations (a finding reproduces with its seed)")
    p.add_argument("--methods", help="only these RPCs, comma-separated (to reproduce a finding); default every RPC")
    p.add_argument("--server-malloc-arenas", type=int, default=0,
                   help="diagnosis: run the server with MALLOC_ARENA_MAX=N (0: as deployed) to tell a leak from arena high-water marks")
    p.add_argument("--tls-dir", help="use ca.pem, server.crt, server.key from here instead of making them")
    p.add_argument("--dir", default="bench-out/fuzz", help="the servers' files; removed at the end")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tqdm(total=args.calls + args.socket_calls, desc="fuzz", unit="call", disable=None) as bar:
        return asyncio.run(fuzz(args, bar))


def print_table(report: dict[str, Any]) -> None:
    print(f"{'method':<19} {'calls':>6} {'msgs':>6}  status codes")
    for name, m in report["methods"].items():
        codes = ", ".join(f"{c} {n}" for c, n in sorted(m["codes"].items(), key=lambda kv: -kv[1]))
        print(f"{name:<19} {m['calls']:>6} {m['messages']:>6}  {codes}")
    print(f"{report['num_calls']} calls, {report['num_messages']} messages; strategies: {report['strategies']}")
    if report.get("socket_methods") == 0:
        print("call socket: none of the fuzzed methods is served there (--methods); its phase was skipped")
    mib = 1 / 2**20
    for key in ("rss_start", "rss_after_warmup", "rss_end"):
        if report.get(key):
            r = report[key]
            print(f"{key:>17}: {r['rss'] * mib:7.1f} MiB (anon {r['anon'] * mib:.1f}, file {r['file'] * mib:.1f}, "
                  f"shmem {r['shmem'] * mib:.1f})")
    print(f"RSS growth after warm-up: {report.get('rss_growth')}; server exit code: {report['server_exit_code']}; "
          f"leases after release: {report.get('leases_after_release')}")
    print(f"acceptance afterwards: {report.get('acceptance')}")
    print(f"load average: start {report['load_avg_start']}, end {report['load_avg_end']}")
    for f in report["faults"]:
        print(f"  FAULT {f}")
    for v in report["violations"]:
        print(f"  VIOLATION {v}")
