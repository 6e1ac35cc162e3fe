"""The checks that need the live cluster, once every fault is healed and every node is up:

* b: every acknowledged durable put is found again (a lookup at every node promises all of
  it, a get delivers its bytes), unless an invalidation of its namespace started after it
  started or was still unsettled when it started; up to its first page an ssd_flip damaged;
* c: at every node, what a lookup of each of the history's prefixes promises is delivered
  whole by a get (no PageMissing: no phantom records), with bytes of the namespace's window.

Both must hold within ``deadline_s`` (2 x TTL) of the heal; polling goes on to ``late_s`` so
that a violation says whether the cluster converged late or not at all (timed per check: ``wait``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from kvstore.bench.chaos.chaos_calls import Clients
from kvstore.bench.chaos.chaos_validate import acknowledged_tokens, generations, identify
from kvstore.bench.chaos.history import History, Violation
from kvstore.bench.chaos.model import LAYOUT, Generations, page_digest, page_digests
from kvstore.client.hit import Hit
from kvstore.errors import KVStoreError


@dataclass(frozen=True)
class Prefix:
    tenant: str
    namespace: str
    root: int
    num_tokens: int
    generation: int | None  # the bytes a durable one must have; None for (c)'s samples


def durable_prefixes(history: History) -> list[Prefix]:
    """The longest acknowledged durable prefix of each (tenant, namespace, root) expected back,
    each cut before its first page an ssd_flip damaged: a durable page whose SSD copy was hit
    may be lost once its node restarts (quarantined, never served); the pages before it may not."""
    gens = generations(history.ops)
    damaged = {key for fault in history.faults for key in fault.keys}
    best: dict[tuple[str, str, int], Prefix] = {}
    for op in history.ops:
        g = gens[(op.tenant, op.namespace)]
        n = acknowledged_tokens(op)
        hit = next((k for k, key in enumerate(op.keys) if key in damaged), None)
        if hit is not None:
            n = min(n, hit * LAYOUT.page_tokens)
        if op.kind != "put" or not op.durable or n == 0 or op.generation is None:
            continue
        if g.invalidated_after(op.start) or g.unsettled_at(op.start) or op.generation != g.lowest(op.start):
            continue  # invalidated since (or maybe), or a stale put that chaos_validate.py reports
        key = (op.tenant, op.namespace, op.root)
        if key not in best or best[key].num_tokens < n:
            best[key] = Prefix(op.tenant, op.namespace, op.root, n, op.generation)
    return list(best.values())


def sampled_prefixes(history: History) -> list[Prefix]:
    """Every (tenant, namespace, root) the history put, at its full length."""
    seen = {(op.tenant, op.namespace, op.root) for op in history.ops if op.kind in ("put", "replicate", "handoff")}
    return [Prefix(t, ns, root, 0, None) for t, ns, root in sorted(seen)]


class Convergence:
    def __init__(self, history: History, clients: Clients, roots: list[list[int]]) -> None:
        self.history = history
        self.clients = clients
        self.roots = roots
        self.gens: dict[tuple[str, str], Generations] = generations(history.ops)
        self.durable = durable_prefixes(history)
        self.samples = sampled_prefixes(history)
        self.nodes = [n.name for n in clients.cluster.nodes]
        self.wrong: dict[str, Violation] = {}  # wrong bytes seen while converging, by message: violations at once

    async def wait(self, healed_at: float, deadline_s: float, late_s: float) -> tuple[float | None, list[Violation]]:
        """Seconds from ``healed_at`` until (b) and (c) held (None: not within ``late_s``), and the violations.
        Each check (a node and a prefix) converged when the read that began its last run of passes
        ended: a round reads every check in turn (seconds under load), so the end of the first clean
        round would count the reads after each check's pass as the cluster's time."""
        passing: dict[tuple[str, int], float] = {}  # each check passing since: when that read ended
        pending: list[str] = []  # what the last round ending by ``deadline_s`` found wrong
        while True:
            problems = await self._round(passing)
            elapsed = time.monotonic() - healed_at
            if not problems:
                converged = max(passing.values(), default=healed_at) - healed_at
                late = [Violation("b/c", f"converged {converged:.1f} s after the heal, past {deadline_s:.1f} s; at "
                                  f"{deadline_s:.0f} s: {'; '.join(pending[:3])}")] if converged > deadline_s else []
                return max(converged, 0.0), [*self.wrong.values(), *late]
            if elapsed > late_s:
                never = [Violation(p[0], f"{p[2:]} (still {late_s:.0f} s after the heal)") for p in problems]
                return None, [*self.wrong.values(), *never]
            if elapsed <= deadline_s or not pending:
                pending = problems
            await asyncio.sleep(0.2)

    async def _round(self, passing: dict[tuple[str, int], float]) -> list[str]:
        """Every check once; ``passing`` keeps, for each check that passes, when its run of passes began."""
        problems = []
        checks = [(prefix, True, "b") for prefix in self.durable] + [(prefix, False, "c") for prefix in self.samples]
        for node in self.nodes:
            for k, (prefix, whole, check) in enumerate(checks):
                problem = await self._read(node, prefix, whole=whole)
                key = (node, k)
                if problem:
                    problems.append(f"{check} {problem}")
                    passing.pop(key, None)
                else:
                    passing.setdefault(key, time.monotonic())
        return problems

    async def _read(self, node: str, prefix: Prefix, whole: bool) -> str | None:
        """None when the read at ``node`` is as it must be, else what is wrong."""
        pages = (prefix.num_tokens or len(self.roots[prefix.root])) // LAYOUT.page_tokens
        tokens = self.roots[prefix.root][:pages * LAYOUT.page_tokens]
        what = f"{prefix.tenant}/{prefix.namespace} root {prefix.root} ({pages} pages) at {node}"
        hit = None
        try:
            client = await self.clients.get(prefix.tenant, node, prefix.namespace)
            hit = await client.lookup(tokens)
            if whole and hit.num_tokens < len(tokens):
                return (f"acknowledged durable prefix {what} (generation {prefix.generation}): lookup promises "
                        f"{hit.num_tokens} of {len(tokens)} tokens (generation {hit.generation}, {_runs(hit)})")
            if hit.num_tokens == 0:
                return None
            out = torch.zeros((LAYOUT.num_layers, LAYOUT.kv_factor, hit.num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                              dtype=LAYOUT.torch_dtype())
            got = await client.get(hit, out)
        except KVStoreError as exc:
            promised = f" (lookup promised {hit.num_tokens} tokens of generation {hit.generation}, {_runs(hit)})" if hit is not None else ""
            return f"{what}{promised}: {type(exc).__name__}: {exc}"
        g = self.gens[(prefix.tenant, prefix.namespace)]
        now = time.monotonic()
        allowed = [prefix.generation] if prefix.generation is not None else list(range(g.lowest(now), g.highest(now) + 1))
        for k, digest in enumerate(page_digests(out, got // LAYOUT.page_tokens)):
            if digest not in {page_digest(prefix.tenant, prefix.namespace, gen, hit.keys[k]) for gen in allowed}:
                message = (f"converging, page {k} of {what} is not of generations {allowed}: "
                           f"{identify(self.history, digest)}")
                self.wrong[message] = Violation("a" if prefix.generation is None else "b", message)
                return f"wrong bytes {what}"
        return None


def _runs(hit: Hit) -> str:
    return "runs " + (", ".join(f"{r.num_pages} on {r.node} {r.tier}" for r in hit.runs) or "none")
