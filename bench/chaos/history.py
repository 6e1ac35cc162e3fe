"""A chaos history as recorded: the operations (arguments, start/end on the monotonic
clock, result or error class), the faults, the violations found; written out as JSON, and
shrunk to a smaller one that still fails."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class Op:
    """One call of one worker. ``generation``: named by a put, learned by a lookup or an
    invalidation. ``result``: tokens stored or read, the new generation, pages a probe saw,
    a hint's answer (0/1). ``pages``: digests of the pages a read delivered, in order."""

    worker: int
    kind: str
    tenant: str
    namespace: str
    node: str
    root: int
    num_pages: int
    durable: bool = False
    replicas: int = 1
    start: float = 0.0
    end: float = 0.0
    generation: int | None = None
    result: int | None = None
    error: str | None = None
    detail: str = ""  # the error's message, cut short
    keys: list[str] = field(default_factory=list)
    pages: list[str] = field(default_factory=list)
    hit_tokens: int | None = None
    to_node: str = ""  # a handoff's decode node
    saved: int | None = None  # the tokens a handoff's save stored (acknowledged)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Fault:
    kind: str
    target: str
    duration_s: float
    start: float = 0.0
    healed: float = 0.0
    error: str | None = None
    detail: str | None = None  # what an instant fault did (arena_flip: how many bytes, in how many arenas)
    keys: list[str] = field(default_factory=list)  # ssd_flip: the pages it damaged (hex keys), which (b) may lose


@dataclass
class Violation:
    check: str  # a (bytes), b (durable), c (phantom), d (deadline), e (resources), and the extra ones in chaos_validate.py
    what: str
    op: int | None = None  # index into History.ops


@dataclass
class History:
    seed: int
    num_ops: int
    kinds: list[str]
    reproduce: str = ""  # the command that runs this history again (on a fresh cluster)
    ops: list[Op] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # wall_start (time.time()), traffic_s, heal_s, convergence_s
    resources: dict[str, int] = field(default_factory=dict)  # the steady node's, after convergence

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path


async def shrink(history: History, rerun: Callable[[int, int, list[str]], Awaitable[History]], attempts: int) -> History:
    """The smallest history found that still violates a check the original violated: fewer
    operations (halved: the same seed's plan, cut short), then one fault kind fewer at a time
    (a plan of the kinds left), ``attempts`` reruns at most. Whether a violation comes back is
    timing, so a step is kept only when it reproduced."""
    checks = {v.check for v in history.violations}
    best = history
    tried = 0

    def fails(candidate: History) -> bool:
        return any(v.check in checks for v in candidate.violations)

    while tried < attempts and best.num_ops > 8:
        tried += 1
        candidate = await rerun(best.seed, best.num_ops // 2, best.kinds)
        if not fails(candidate):
            break
        best = candidate
    for kind in list(best.kinds):
        if tried >= attempts or len(best.kinds) <= 1:
            break
        tried += 1
        candidate = await rerun(best.seed, best.num_ops, [k for k in best.kinds if k != kind])
        if fails(candidate):
            best = candidate
    logger.info("shrunk history %d to %d ops, kinds %s in %d reruns", history.seed, best.num_ops, best.kinds, tried)
    return best
