"""Decode side of a handoff for hybrid engines: the wait for the completion marker runs in
the background, and once it answered the load (hybrid_worker.py's: every group and the
states, or nothing) runs between steps, as a hybrid hit's does (DESIGN §12.7).

More: client/adapters/vllm/README.md (### hybrid_handoff.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.metadata import GroupLoad
from kvstore.client.client import KVStoreClient
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)

GRACE_S = 5.0  # past its deadline, how long a wait may still run before it is given up on (pd_worker.py's)
IDLE_WAIT_S = 0.002  # a step that computed nothing waits this long at most for a marker (pd_worker.py's IDLE_WAIT_S)


@dataclass
class Waiting:
    spec: GroupLoad
    give_up_at: float  # monotonic
    client: KVStoreClient | None = None
    job: Any = None  # the runtime's Job of the handoff_wait: ``job.result`` is a concurrent Future of its Hit


@dataclass
class Answered:
    """A wait that ended: the client it ran on (None: it never started) and the leading pages
    of the load's tokens held at the node for it (0: none, or the wait failed or timed out)."""

    spec: GroupLoad
    client: KVStoreClient | None
    num_pages: int
    reason: str


class HybridReceives:
    """The handoff loads of a hybrid engine's decode side, waiting for their markers."""

    def __init__(self, store: StoreConnection) -> None:
        self.store = store
        self._waiting: list[Waiting] = []

    def start(self, client: KVStoreClient | None, spec: GroupLoad) -> None:
        deadline_s = spec.deadline_s or 0.0
        waiting = Waiting(spec, time.monotonic() + deadline_s + GRACE_S)
        if client is not None and deadline_s > 0:
            try:
                waiting.client, waiting.job = client, client.runtime.submit(client.handoff_wait(spec.handoff_id, spec.tokens,
                                                                                                deadline_s))
            except KVStoreError as exc:  # its runtime closed under this step
                logger.warning("kvstore handoff %s of request %s: wait not started: %s", spec.handoff_id, spec.req_id, exc)
        self._waiting.append(waiting)

    def __len__(self) -> int:
        return len(self._waiting)

    def answered(self, idle: bool) -> list[Answered]:
        """The waits that ended (or were given up on, past their deadline + ``GRACE_S``).
        ``idle``: the step computed nothing, so it waits ``IDLE_WAIT_S`` at most for one first."""
        running = [w.job.result for w in self._waiting if w.job is not None and not w.job.result.done()]
        if idle and running:
            concurrent.futures.wait(running, IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED)
        now, out, still = time.monotonic(), [], []
        for waiting in self._waiting:
            if waiting.job is not None and not waiting.job.result.done() and now <= waiting.give_up_at:
                still.append(waiting)
            else:
                out.append(self._ended(waiting))
        self._waiting = still
        return out

    def _ended(self, waiting: Waiting) -> Answered:
        spec, job = waiting.spec, waiting.job
        if job is None:
            return Answered(spec, None, 0, "the store could not be reached")
        result = job.result
        if not result.done():
            job.cancel()
            return Answered(spec, waiting.client, 0, f"no marker within {spec.deadline_s:.1f} s (+{GRACE_S:.0f} s)")
        if result.cancelled() or result.exception() is not None:
            exc = None if result.cancelled() else result.exception()
            if exc is not None and waiting.client is not None:  # a transport failure drops the client
                self.store.failed(waiting.client, exc)
            return Answered(spec, waiting.client, 0, f"the wait failed: {exc!r}")
        held = result.result().num_tokens // waiting.client.layout.page_tokens if waiting.client is not None else 0
        return Answered(spec, waiting.client, held, "the handoff held fewer pages (missing, foreign or expired)")

    def shutdown(self) -> None:
        for waiting in self._waiting:
            if waiting.job is not None and not waiting.job.result.done():
                waiting.job.cancel()
        self._waiting = []
