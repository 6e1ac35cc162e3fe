"""Random concurrent traffic of a chaos history: a few workers, each a paced loop of random
operations at random nodes as random tenants, over prefixes of 1-4 pages of a few token
sequences (so keys collide across workers). The plan is drawn from the history's seed; the
calls and what they returned are recorded (``chaos_calls.py``)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.bench.chaos.chaos_calls import Calls, Clients
from kvstore.bench.chaos.history import Op
from kvstore.bench.chaos.model import LAYOUT

MAX_PAGES = 4
NUM_ROOTS = 4  # token sequences per history: small, so that workers' keys collide
NAMESPACES_PER_TENANT = 2
# kind -> weight. put/replicate name the generation the worker last learned; a put is often
# preceded by a lookup that learns it (an engine's lookup, compute the rest, put)
WEIGHTS = {"put": 24, "read": 30, "replicate": 7, "hint": 7, "invalidate": 5, "key_invalidate": 3, "probe": 6, "handoff": 8}
LOOKUP_BEFORE_PUT = 0.6
DURABLE = 0.4


@dataclass(frozen=True)
class Planned:
    worker: int
    at_s: float  # after the traffic's start: the ops of a worker are spread over the history
    kind: str
    tenant: str
    namespace: str
    node: str
    root: int
    num_pages: int
    durable: bool = False
    lookup_first: bool = False
    eta_s: float = 0.0


def plan_traffic(rng: random.Random, num_ops: int, num_workers: int, nodes: list[str], tenants: list[str],
                 namespaces: list[str], traffic_s: float) -> tuple[list[list[int]], list[Planned]]:
    """The token sequences and the operations, in plan order (worker i takes every
    ``num_workers``-th). Truncating ``num_ops`` gives a prefix of the same plan."""
    roots = [[rng.randrange(50_000) for _ in range(MAX_PAGES * LAYOUT.page_tokens)] for _ in range(NUM_ROOTS)]
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    per_worker = max(1, -(-num_ops // num_workers))
    plan = []
    for i in range(num_ops):
        kind = rng.choices(kinds, weights)[0]
        plan.append(Planned(
            worker=i % num_workers, at_s=(i // num_workers) * traffic_s / per_worker + rng.uniform(0, 0.05), kind=kind,
            tenant=rng.choice(tenants), namespace=rng.choice(namespaces), node=rng.choice(nodes), root=rng.randrange(NUM_ROOTS),
            num_pages=rng.randint(1, MAX_PAGES), durable=kind == "put" and rng.random() < DURABLE,
            lookup_first=rng.random() < LOOKUP_BEFORE_PUT, eta_s=rng.uniform(0.1, 1.0)))
    return roots, plan


class Traffic:
    """Runs a plan with ``num_workers`` concurrent workers on the caller's loop; each op is
    one ``Op`` appended to ``ops`` as it ends."""

    def __init__(self, clients: Clients, roots: list[list[int]], plan: list[Planned], num_workers: int,
                 on_op: Callable[[Op], None] | None = None) -> None:
        self.clients = clients
        self.roots = roots
        self.plan = plan
        self.num_workers = num_workers
        self.ops: list[Op] = []
        self._on_op = on_op
        # what each worker last learned of each namespace's generation (0: a fresh namespace's)
        self._known: list[dict[tuple[str, str], int]] = [{} for _ in range(num_workers)]

    async def run(self) -> list[Op]:
        start = time.monotonic()
        await asyncio.gather(*(self._worker(w, start) for w in range(self.num_workers)))
        return self.ops

    async def _worker(self, worker: int, start: float) -> None:
        known = self._known[worker]
        calls = Calls(self.clients, worker, known, self._record)
        for planned in self.plan[worker::self.num_workers]:
            delay = start + planned.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tokens = self.roots[planned.root][:planned.num_pages * LAYOUT.page_tokens]
            await calls.do(planned, tokens)

    def _record(self, op: Op) -> None:
        self.ops.append(op)
        if self._on_op is not None:
            self._on_op(op)
