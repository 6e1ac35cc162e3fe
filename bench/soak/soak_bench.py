"""kvstore-bench soak: N client processes of two tenants (each client its own token) run a
mixed put / lookup / get / layer-wise save and load workload against a real kvstore-server
with TLS and auth on, every read checked bit-exact; then the same workload against a plain
loopback server (no TLS, no auth file), back to back. Reported: errors, wrong bytes, latency,
server RSS growth, and the cost of TLS + auth.

More: bench/soak/README.md (### soak_bench.py).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from statistics import quantiles
from typing import Any

import grpc
from tqdm import tqdm

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.bench.common.harness import rss, start_server
from kvstore.bench.common.secure import Credentials, make_credentials
from kvstore.bench.soak import soak_cpu, soak_rounds, soak_tiers, soak_worker
from kvstore.security.channel import sync_channel

TENANTS = ("alpha", "beta")
OPS = ("put", "lookup", "get", "save", "load")
# name -> (TLS, auth, shared arena). The default runs the first four in this order: secure, plain,
# plain, secure cancels a drift in the machine's load out of the cost comparison. The tls-* and
# auth-* phases (only when named) tell which of the two a cost comes from. local-shm: the
# secure server (TLS port, tokens), its same-host clients on its --local-socket (tokens, no TLS).
LOCAL_PHASES = {"local-shm"}
PHASES = {"local-shm": (True, True, True), "secure-shm": (True, True, True), "plain-shm": (False, False, True), "plain-grpc": (False, False, False),
          "secure-grpc": (True, True, False), "tls-shm": (True, False, True), "auth-shm": (False, True, True),
          "tls-grpc": (True, False, False), "auth-grpc": (False, True, False)}
DEFAULT_PHASES = "secure-shm,plain-shm,plain-grpc,secure-grpc"


def _percentiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (0.0, 0.0)
    cuts = quantiles(values, n=100, method="inclusive")
    return cuts[49], cuts[98]


class Clients:
    """The client processes, started once and reused by every phase."""

    def __init__(self, count: int) -> None:
        # no fork of a process that holds gRPC threads: forked by a server that imported the worker (torch) once
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["kvstore.bench.soak.soak_worker"])
        self.pipes: list[Connection] = []
        self.procs: list[BaseProcess] = []
        for index in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=soak_worker.main, args=(index, child), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def start(self, phases: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any] | None], int]:
        """Hands each client its phase, waits until all connected, and starts them together;
        returns the start (wall clock), the results so far (those that could not connect) and
        how many clients mapped the shared arena."""
        for pipe, phase in zip(self.pipes, phases):
            pipe.send(phase)
        results: list[dict[str, Any] | None] = [None] * len(self.pipes)
        shared = 0
        for i, pipe in enumerate(self.pipes):
            if not pipe.poll(300):
                raise RuntimeError(f"soak client {i} did not connect within 300 s")
            first = pipe.recv()
            if not first.get("connected"):
                results[i] = first  # could not connect: its errors are in the result
            shared += bool(first.get("shared_memory"))
        start = time.time() + 0.25  # every client is connected and waits on its pipe; a late one starts late, same window
        for i, pipe in enumerate(self.pipes):
            if results[i] is None:
                pipe.send(start)
        return start, results, shared

    def finish(self, results: list[dict[str, Any] | None], wait_s: float) -> list[dict[str, Any]]:
        """Every client's results, in client order."""
        for i, pipe in enumerate(self.pipes):
            if results[i] is None:
                if not pipe.poll(wait_s):
                    raise RuntimeError(f"soak client {i} did not finish within {wait_s:.0f} s")
                results[i] = pipe.recv()
        return results  # type: ignore[return-value]  # every slot is filled now

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _phase(name: str, clients: Clients, creds: Credentials, args: argparse.Namespace, workdir: Path,
           bar: tqdm[Any]) -> dict[str, Any]:
    tls, auth, use_shm = PHASES[name]
    shutil.rmtree(workdir / name, ignore_errors=True)
    sock_dir = Path(tempfile.mkdtemp(prefix="kvsoak-"))  # a Unix socket path has at most 107 bytes
    local = sock_dir / "kv.sock" if name in LOCAL_PHASES else None
    # with auth: one arena per tenant, of its host_bytes quota; together the plain server's one arena
    quota = ("--tenant-host-bytes", str((args.host_capacity << 20) // len(TENANTS))) if auth else ()
    server, addr = start_server(workdir / name, args.host_capacity << 20, 64 << 20, "--tiers", "host", *quota,
                                *(("--auth-file", str(creds.auth_file)) if auth else ()),
                                *(("--tls-cert", str(creds.cert), "--tls-key", str(creds.key)) if tls else ()),
                                *(("--local-socket", str(local)) if local else ()))
    client_addr, client_tls = (f"unix:{local}", False) if local else (addr, tls)
    per_tenant = len(clients.pipes) // len(TENANTS)
    specs = []
    for i in range(len(clients.pipes)):
        tenant = TENANTS[min(i // max(1, per_tenant), len(TENANTS) - 1)]
        specs.append({"address": client_addr, "tenant": tenant, "use_shm": use_shm, "revision": name, "seed": args.seed,
                      "prompts": args.prompts, "warmup_s": args.warmup_s, "duration_s": args.duration_s,
                      "token": creds.tokens[tenant][i % per_tenant] if auth else None,
                      "tls_ca": str(creds.ca) if client_tls else None})
    load_start = os.getloadavg()
    try:
        start, pending, shared = clients.start(specs)
        cpu = soak_cpu.Window(server.proc.pid, [proc.pid for proc in clients.procs if proc.pid], start + args.warmup_s)
        with sync_channel(addr, token=creds.admin if auth else None, tls=creds.tls() if tls else None) as channel:
            timeline, host = _sample(server.proc, directory_pb2_grpc.DirectoryStub(channel), start,
                                     args.warmup_s + args.duration_s, bar, cpu)
        results = clients.finish(pending, 120)
        alive = server.proc.poll() is None
    finally:
        server.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    summary = _summary(name, results, timeline, alive, args, load_start)
    return {**summary, "cpu": cpu.summary(summary["ops_per_s"]), "shared_memory_clients": shared, "host_tier": soak_tiers.window(host, args.warmup_s, summary)}


def _sample(server: subprocess.Popen[str], directory: Any, start: float, total_s: float, bar: tqdm[Any],
            cpu: soak_cpu.Window) -> tuple[list[tuple[float, int, int]], list[tuple[float, dict[str, Any]]]]:
    """(seconds since the start, server RSS bytes, events the server has logged) every second
    until the phase ends (or the server), and the host tier's figures then (soak_tiers). The
    event log Subscribe reads keeps the last 65,536 events in a buffer resident from the
    server's start (72 B a record): its filling no longer grows RSS; the count shows how far it
    is filled. A Stats call that fails while the server runs is logged as -1 events: the
    verdict is the clients' to give. ``cpu`` takes its readings at the same ticks."""
    timeline: list[tuple[float, int, int]] = []
    host: list[tuple[float, dict[str, Any]]] = []
    shown = 0
    while (now := time.time()) < start + total_s + 0.5 and server.poll() is None:
        if now >= start:
            try:
                stats = directory.Stats(directory_pb2.StatsRequest(), timeout=30)
                last_seq = int(stats.last_seq)
                host.append((round(now - start, 1), soak_tiers.snapshot(stats)))
            except grpc.RpcError:
                if server.poll() is not None:
                    break
                last_seq = -1
            timeline.append((round(now - start, 1), rss(server.pid)["rss"], last_seq))
            if now < start + total_s:
                cpu.tick(now)
            elapsed = min(int(now - start), int(total_s))
            bar.update(elapsed - shown)
            shown = elapsed
            bar.set_postfix_str(f"server RSS {timeline[-1][1] >> 20} MiB", refresh=False)
        now = time.time()  # ticks 1 s apart from the start, no wait past the start or the end
        time.sleep(min(1.0, max(0.0, (start if now < start else start + total_s + 0.5) - now)))
    bar.update(int(total_s) - shown)
    return timeline, host


def _summary(name: str, results: list[dict[str, Any]], timeline: list[tuple[float, int, int]], alive: bool,
             args: argparse.Namespace, load_start: tuple[float, ...]) -> dict[str, Any]:
    window = (args.warmup_s, args.warmup_s + args.duration_s)
    samples = [s for r in results for s in r["samples"]]
    ops: dict[str, Any] = {}
    for op in OPS:
        lat = [s[2] for s in samples if s[1] == op and window[0] <= s[0] < window[1]]
        p50, p99 = _percentiles(lat)
        ops[op] = {"count": len(lat), "p50_ms": round(p50 * 1e3, 3), "p99_ms": round(p99 * 1e3, 3)}
    counts: dict[str, int] = {}
    for r in results:
        for key, value in r["counts"].items():
            counts[key] = counts.get(key, 0) + value
    # minute 1 of the run (the event log, caches and heaps have filled by then); a run shorter
    # than two minutes: the end of its warm-up
    baseline_at = max(args.warmup_s, 60.0) if args.warmup_s + args.duration_s >= 120 else args.warmup_s
    base, base_events = next(((b, e) for t, b, e in timeline if t >= baseline_at), (None, None))
    end, end_events = timeline[-1][1:] if timeline else (None, None)
    growth = round(end / base - 1, 4) if base and end else None
    return {
        "phase": name, "clients": len(results), "duration_s": args.duration_s, "warmup_s": args.warmup_s,
        "ops": ops, "ops_per_s": round(sum(o["count"] for o in ops.values()) / args.duration_s, 1),
        "counts": counts, "error_samples": [e for r in results for e in r["error_samples"]][:20],
        "server_alive": alive, "rss_baseline_at_s": baseline_at, "rss_baseline": base, "rss_end": end, "rss_growth": growth,
        "events_logged_at_baseline": base_events, "events_logged_at_end": end_events,
        "rss_timeline": timeline, "latency_samples": samples if args.plot else [],
        "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
    }


def _versus(phase: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """``phase`` vs ``plain``: ratios of p50/p99 per operation, and the slowdown in ops/s."""
    per_op = {op: {"p50_ratio": round(phase["ops"][op]["p50_ms"] / plain["ops"][op]["p50_ms"], 3),
                   "p99_ratio": round(phase["ops"][op]["p99_ms"] / plain["ops"][op]["p99_ms"], 3)}
              for op in OPS if plain["ops"][op]["p50_ms"] and phase["ops"][op]["p50_ms"]}
    slowdown = round(plain["ops_per_s"] / phase["ops_per_s"] - 1, 3) if phase["ops_per_s"] else None
    return {"per_op": per_op, "slowdown": slowdown}


def _cost(phases: dict[str, dict[str, Any]], rounds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Secure (TLS + auth) vs plain, per transport, against its goal; and TLS alone, auth
    alone vs plain where those phases ran. Where rounds ran, each entry carries them under
    "rounds", and their median, not the one phase pair, decides meets_goal."""
    cost: dict[str, Any] = {}
    for transport, goal in (("shm", 0.05), ("grpc", 0.15)):
        plain = phases.get(f"plain-{transport}")
        if not plain:
            continue
        if secure := phases.get(f"secure-{transport}"):
            cost[transport] = {**_versus(secure, plain), "goal_slowdown": goal}
            cost[transport]["meets_goal"] = cost[transport]["slowdown"] is not None and cost[transport]["slowdown"] <= goal
        for part in ("tls", "auth"):
            if alone := phases.get(f"{part}-{transport}"):
                cost.setdefault(transport, {})[f"{part}_only"] = _versus(alone, plain)
        if transport == "shm" and (local := phases.get("local-shm")):  # the same-host path of a secure server
            entry = {**_versus(local, plain), "goal_slowdown": goal}
            entry["meets_goal"] = entry["slowdown"] is not None and entry["slowdown"] <= goal
            cost.setdefault(transport, {})["local_socket"] = entry
    for name, measured in rounds.items():
        part, transport = name.split("-")
        entry = cost.get(transport, {})
        entry = entry if part == "secure" else entry.get("local_socket" if part == "local" else f"{part}_only")
        if entry is None:
            continue
        entry["rounds"] = measured
        if "goal_slowdown" in entry:
            entry["meets_goal"] = measured["slowdown_median"] is not None and measured["slowdown_median"] <= entry["goal_slowdown"]
            entry["meets_goal_by"] = "rounds median"
    return cost


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    per_tenant = max(1, args.clients // len(TENANTS))
    creds = make_credentials(workdir / "security", {t: per_tenant for t in TENANTS}, Path(args.tls_dir) if args.tls_dir else None)
    names = args.phases
    clients = Clients(args.clients)
    phases: dict[str, dict[str, Any]] = {}
    rounds: dict[str, dict[str, Any]] = {}
    total = len(names) * (args.warmup_s + args.duration_s) + soak_rounds.total_s(names, args)
    try:
        with tqdm(total=int(total), desc="soak", unit="s", disable=None) as bar:
            for name in names:
                bar.set_description(f"soak {name}")
                phases[name] = p = _phase(name, clients, creds, args, workdir, bar)
                # one line per phase even when stderr is not a terminal (no bar then): a long run shows progress
                print(f"soak: {name} done: {p['ops_per_s']} ops/s, {p['counts'].get('errors', 0)} errors, "
                      f"{p['counts'].get('wrong_bytes', 0)} wrong bytes, server RSS growth {p['rss_growth']}", file=sys.stderr)
            if args.rounds > 0:
                bar.set_description("soak rounds")
                rounds = soak_rounds.run(lambda name, a: _phase(name, clients, creds, a, workdir, bar), names, args)
    finally:
        clients.close()
        shutil.rmtree(workdir, ignore_errors=True)
    violations = []
    for name, p in phases.items():
        c = p["counts"]
        if c.get("errors") or c.get("wrong_bytes"):
            violations.append(f"{name}: {c.get('errors', 0)} errors, {c.get('wrong_bytes', 0)} wrong bytes: {p['error_samples'][:3]}")
        if not p["server_alive"]:
            violations.append(f"{name}: the server exited during the run")
        if p["rss_growth"] is None or p["rss_growth"] >= 0.05:
            violations.append(f"{name}: server RSS growth {p['rss_growth']} from {p['rss_baseline_at_s']} s to the end (limit 5%)")
    violations += soak_rounds.violations(rounds)
    if args.plot:
        from kvstore.bench.soak.soak_plot import plot

        plot(phases, args.plot)
    for p in phases.values():
        p.pop("latency_samples", None)
        # the report keeps one sample in 10 (and the last): the JSON line stays readable; the plot has them all
        every = p["rss_timeline"]
        p["rss_timeline"] = [sample for i, sample in enumerate(every) if i % 10 == 0 or i == len(every) - 1]
    return {"clients": args.clients, "auth_file_tenants": {t: len(ts) for t, ts in creds.tokens.items()}, "phases": phases, "tls_auth_cost": _cost(phases, rounds),
            "cost_rounds": rounds,
            "plot": args.plot, "violations": violations, "num_violations": len(violations)}


def _phase_names(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    if not names or any(n not in PHASES for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated, of {', '.join(PHASES)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--clients", type=int, default=16, help="client processes, half per tenant, each its own token")
    p.add_argument("--duration-s", type=float, default=60.0, help="measured seconds per phase, after the warm-up")
    p.add_argument("--warmup-s", type=float, default=60.0,
                   help="seconds per phase before the measurement (latency) and the RSS baseline (minute 1)")
    p.add_argument("--phases", type=_phase_names, default=DEFAULT_PHASES,
                   help=f"comma-separated, of {', '.join(PHASES)} (tls-*, auth-*: one of the two alone)")
    p.add_argument("--prompts", type=int, default=512, help="prompts per tenant (~8 pages of 32 KiB each)")
    p.add_argument("--host-capacity", type=int, default=128, help="server host tier, MiB (less than the prompts: eviction)")
    p.add_argument("--seed", type=int, default=0, help="of the clients' operation mix")
    soak_rounds.add_arguments(p)
    p.add_argument("--plot", metavar="PNG", help="write a PNG of p50/p99 latency and server RSS over time here")
    p.add_argument("--tls-dir", help="use ca.pem, server.crt, server.key from here instead of making them")
    p.add_argument("--dir", default="bench-out/soak", help="the servers' files; removed at the end")


def print_table(report: dict[str, Any]) -> None:
    print(f"{report['clients']} clients; tokens per tenant {report['auth_file_tenants']}; latency ms after the warm-up (p50 / p99)")
    print(f"{'phase':<12} {'ops/s':>7} " + " ".join(f"{op:>15}" for op in OPS) + f" {'errors':>6} {'wrong':>5} {'miss':>5} "
          f"{'RSS MiB base->end':>18} {'growth':>7}  load avg")
    for name, p in report["phases"].items():
        lat = " ".join(f"{o['p50_ms']:>7.2f}/{o['p99_ms']:<7.2f}" for o in p["ops"].values())
        c = p["counts"]
        mib = f"{(p['rss_baseline'] or 0) / 2**20:.0f}->{(p['rss_end'] or 0) / 2**20:.0f}"
        print(f"{name:<12} {p['ops_per_s']:>7.1f} {lat} {c.get('errors', 0):>6} {c.get('wrong_bytes', 0):>5} "
              f"{c.get('misses', 0):>5} {mib:>18} {p['rss_growth']!s:>7}  {p['load_avg_start'][0]:.1f}->{p['load_avg_end'][0]:.1f}")
    print("RSS: from minute 1 (a run shorter than 2 minutes: the end of its warm-up) to the end; the server's event log "
          "(65,536 events, resident from the start) fills meanwhile: " + ", ".join(
              f"{n} {p['events_logged_at_baseline']}->{p['events_logged_at_end']}" for n, p in report["phases"].items()))
    print("CPU per op in the measured window (soak_cpu.py): " + "; ".join(
        f"{n} server {_ms(p.get('cpu', {}).get('server_ms_per_op'))}, clients {_ms(p.get('cpu', {}).get('clients_ms_per_op'))}"
        for n, p in report["phases"].items()))
    print("host tier in the measured window (like-for-like only if both sides evict alike): " + "; ".join(
        _host_line(n, p) for n, p in report["phases"].items()))
    for transport, c in report["tls_auth_cost"].items():
        for label, part in (("TLS+auth", c), ("TLS alone", c.get("tls_only")), ("auth alone", c.get("auth_only")),
                            ("tokens on --local-socket (no TLS)", c.get("local_socket"))):
            if not part or "slowdown" not in part:
                continue
            goal = (f" (goal <= {part['goal_slowdown']:.0%}: {'met' if part['meets_goal'] else 'NOT met'})"
                    if "goal_slowdown" in part else "")
            slower = "n/a" if part["slowdown"] is None else f"{part['slowdown']:+.1%}"
            ratios = ", ".join(f"{op} p50 x{r['p50_ratio']}" for op, r in part["per_op"].items())
            rounds = part.get("rounds")  # when run, the verdict is theirs
            print(f"{label} cost, {transport}: {slower} ops/s in one phase pair{'' if rounds else goal}; {ratios}")
            if rounds:
                print(f"  {soak_rounds.line(rounds)}{goal}")
    if report["plot"]:
        print(f"latency over time: {report['plot']}")
    for v in report["violations"]:
        print(f"  VIOLATION {v}")


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} ms"


def _host_line(name: str, p: dict[str, Any]) -> str:
    h = p.get("host_tier")
    if not h:
        return f"{name}: no Stats"
    quotas = "".join(f", {t} quota {u['host_bytes_quota'] >> 20} MiB" for t, u in h["tenants_end"].items()
                     if u["host_bytes_quota"] and t in TENANTS)
    rate, found = (("n/a" if v is None else f"{v:.1%}") for v in (h["hit_rate_measured"], h["tokens_found_measured"]))
    return (f"{name} {h['capacity_bytes'] >> 20} MiB{quotas}: {h['evictions_measured']} evictions "
            f"({h['evictions_per_put']} per put), Acquire hit rate {rate}, {found} of looked-up tokens found")
