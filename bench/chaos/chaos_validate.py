"""Checks of a recorded history against the model (``model.py``), after the fact: (a),
stale_put, supersede, key_invalidate, tenant, tenant_refused and (d).

(b) and (c) need the live cluster: ``converge.py``; (e) spans histories: ``run.py``.

More: bench/chaos/README.md (### chaos_validate.py).
"""

from __future__ import annotations

from collections import defaultdict

from kvstore.bench.chaos.chaos_calls import ROUNDS
from kvstore.bench.chaos.history import History, Op, Violation
from kvstore.bench.chaos.model import Generations, page_digest

# A call may end this long after its RPCs' deadlines. Measured here: a call to a SIGSTOPped
# node (lookup, put, get, invalidate) ends 1-7 ms past its deadline; the bench's loop is
# shared by four workers, the fault injector and the clients' I/O threads on 2 cores, where
# a put's KV is made on the loop and node restarts compete for the CPU, so 1 s is the slack
# for a stalled loop, not for the deadline itself.
MARGIN_S = 1.0


def generations(ops: list[Op]) -> dict[tuple[str, str], Generations]:
    """Each namespace's invalidations in the history."""
    table: dict[tuple[str, str], Generations] = defaultdict(Generations)
    for op in ops:
        if op.kind == "invalidate":
            table[(op.tenant, op.namespace)].add(op.start, op.end, op.result if op.ok else None)
    return table


def acknowledged_tokens(op: Op) -> int:
    """Tokens a put was acknowledged for: its result, or a durable put's durable prefix
    (PageMissing); a handoff's save: what it stored."""
    if op.kind == "handoff":
        return op.saved or 0
    if op.kind not in ("put", "replicate") or op.result is None:
        return 0
    return op.result if op.ok or op.error == "PageMissing" else 0


def check(history: History, timeout_s: float) -> list[Violation]:
    ops = history.ops
    gens = generations(ops)
    found: list[Violation] = []
    for i, op in enumerate(ops):
        g = gens[(op.tenant, op.namespace)]
        budget = ROUNDS[op.kind] * timeout_s + MARGIN_S
        if op.end - op.start > budget:
            found.append(Violation("d", f"{op.kind} at {op.node} took {op.end - op.start:.2f} s > {budget:.1f} s ({op.error})", i))
        if op.kind in ("read", "handoff") and op.pages:
            low, high = g.lowest(op.start), g.highest(op.end)
            for k, got in enumerate(op.pages):
                key = bytes.fromhex(op.keys[k])
                if got not in {page_digest(op.tenant, op.namespace, gen, key) for gen in range(low, high + 1)}:
                    found.append(Violation("a", f"page {k} read at {op.to_node or op.node} is not of generations {low}..{high}: "
                                           f"{identify(history, got)}", i))
        if op.kind in ("put", "replicate", "handoff") and acknowledged_tokens(op) > 0 and op.generation is not None:
            low = g.lowest(op.start)
            if op.generation < low:
                found.append(Violation("stale_put", f"a put naming generation {op.generation} was acknowledged at {op.node} "
                                       f"after an invalidation to {low} was", i))
        if op.kind == "key_invalidate" and op.result == 1:
            found.append(Violation("key_invalidate", f"key-level invalidation was accepted at {op.node} in cluster mode", i))
        if op.kind != "probe" and op.error in ("PermissionDenied", "grpc.PERMISSION_DENIED") and not _probed_meanwhile(ops, op):
            found.append(Violation("tenant_refused", f"{op.kind} of tenant {op.tenant} in its own namespace refused at "
                                   f"{op.node}: {op.detail}", i))
        if op.kind == "probe" and op.result:
            found.append(Violation("tenant", f"the other tenant saw {op.result} pages of {op.tenant}'s namespace at {op.node}", i))
    found += _supersede(ops)
    return found


def _probed_meanwhile(ops: list[Op], op: Op) -> bool:
    """Whether the other tenant's probe of ``op``'s namespace ran at its node while ``op`` did.
    A read of a namespace bound to nobody at a node claims it for the reader while its fetch
    runs (server/tenancy/cluster_reads.py: so that nobody else binds it meanwhile), and a first
    write of the real owner there meanwhile is refused: the price of a leaked namespace id,
    which the probe plays (ids are salted: another tenant cannot compute them)."""
    return any(p.kind == "probe" and p.tenant == op.tenant and p.namespace == op.namespace and p.node == op.node
               and p.start < op.end and op.start < p.end for p in ops)


def _supersede(ops: list[Op]) -> list[Violation]:
    """Each acknowledged invalidation's generation is above every generation acknowledged
    (by an invalidation, or named by an acknowledged put) before it started."""
    found = []
    by_namespace: dict[tuple[str, str], list[tuple[int, Op]]] = defaultdict(list)
    for i, op in enumerate(ops):
        by_namespace[(op.tenant, op.namespace)].append((i, op))
    for members in by_namespace.values():
        acknowledged = [(j, op) for j, op in members if (op.kind == "invalidate" and op.ok) or acknowledged_tokens(op) > 0]
        for i, op in members:
            if op.kind != "invalidate" or not op.ok or op.result is None:
                continue
            earlier = [(_generation_of(e), j, e) for j, e in acknowledged if e.end < op.start and _generation_of(e) is not None]
            if earlier and op.result <= max(earlier, key=lambda t: t[0])[0]:
                gen, j, e = max(earlier, key=lambda t: t[0])
                found.append(Violation("supersede", f"invalidation of {op.tenant}/{op.namespace} at {op.node} was acknowledged "
                                       f"with generation {op.result}, not above generation {gen} of the {e.kind} at {e.node} "
                                       f"(op {j}) acknowledged before it started", i))
    return found


def _generation_of(op: Op) -> int | None:
    return op.result if op.kind == "invalidate" else op.generation


def identify(history: History, got: str) -> str:
    """What a wrong page is: a page of another generation, key, namespace or tenant the history used, or unknown bytes."""
    keys = {(op.tenant, op.namespace, bytes.fromhex(k)) for op in history.ops for k in op.keys}
    top = 1 + sum(1 for op in history.ops if op.kind == "invalidate")
    for tenant, namespace, key in keys:
        for gen in range(top + 1):
            if page_digest(tenant, namespace, gen, key) == got:
                return f"it is tenant {tenant}'s page {key.hex()[:12]} of namespace {namespace}, generation {gen}"
    return "bytes of no page this history put (zeros, torn or foreign)"
