"""Decode side of a handoff for hybrid engines: the wait for the completion marker and the get
of the handed-off pages (verified, into a staging tensor) run in the background; once they
ended, the pages are written into every group's blocks between steps, with the states after
the last page (hybrid_worker.py), or the request fails and recomputes (DESIGN §12.7).

More: client/adapters/vllm/README.md (### hybrid_handoff.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.metadata import GroupLoad
from kvstore.client.adapters.vllm.pd_jobs import let_go
from kvstore.client.client import Hit, KVStoreClient
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)

GRACE_S = 5.0  # past its deadline, how long a wait may still run before it is given up on (pd_worker.py's)
IDLE_WAIT_S = 0.002  # a step that computed nothing waits this long at most for a marker (pd_worker.py's IDLE_WAIT_S)


@dataclass
class Waiting:
    spec: GroupLoad
    start_by: float  # monotonic: a receive with no store to start on is started again until then
    give_up_at: float
    client: KVStoreClient | None = None
    job: Any = None  # the runtime's Job of ``_receive``: ``job.result`` is a concurrent Future of its page count
    staging: torch.Tensor | None = None  # every handed-off page, once got


@dataclass
class Answered:
    """A receive that ended: the leading pages of the load's tokens got into ``staging`` (0: none,
    or the wait or the get failed, timed out, or its request went); ``reason``: why fewer."""

    spec: GroupLoad
    num_pages: int
    staging: torch.Tensor | None
    reason: str


class HybridReceives:
    """The handoff loads of a hybrid engine's decode side, received in the background.
    ``staging(n)``: a tensor for ``n`` pages of every layer (GroupedBlocks.staging)."""

    def __init__(self, store: StoreConnection, staging: Callable[[int], torch.Tensor]) -> None:
        self.store = store
        self.staging = staging
        self._waiting: list[Waiting] = []
        self._gone: set[str] = set()  # requests vLLM finished (aborted) while their receive ran

    def start(self, client: KVStoreClient | None, spec: GroupLoad) -> None:
        now = time.monotonic()
        waiting = Waiting(spec, now + spec.handoff_wait_s, now + spec.handoff_wait_s + GRACE_S)
        self._start(waiting, client, spec.handoff_wait_s)
        self._waiting.append(waiting)

    def _start(self, waiting: Waiting, client: KVStoreClient | None, wait_s: float) -> None:
        """Starts the receive on ``client``; none (the store reconnecting: a node restarted): the
        next ``answered`` starts it again, until its wait's end (as pd_receives.py does)."""
        spec = waiting.spec
        if client is None or wait_s <= 0:
            return
        waiting.spec = replace(spec, handoff_wait_s=wait_s)
        coro = self._receive(client, waiting)
        try:
            waiting.client, waiting.job = client, client.runtime.submit(coro)
        except KVStoreError as exc:  # its runtime closed under this step
            coro.close()
            logger.warning("kvstore handoff %s of request %s: receive not started: %s", spec.handoff_id, spec.req_id, exc)

    async def _receive(self, client: KVStoreClient, waiting: Waiting) -> int:
        """Waits for the marker, then gets the load's pages (verified) into ``waiting.staging``,
        only those: pages before them (vLLM's own cache holds them) are not read. Returns how many
        leading pages of the load's tokens are there. Unless it got every page the wait answered
        (the node then let go of the handoff: HandoffMarkers.acquired), it lets go once it ended
        however it ended (pages before the load's, short, failed, cancelled): ``let_go``."""
        spec, p = waiting.spec, client.layout.page_tokens
        got_all = False
        try:
            hit = await client.handoff_wait(spec.handoff_id, spec.tokens, spec.handoff_wait_s)
            first, end = spec.first_page, spec.first_page + spec.num_pages
            if hit.num_tokens // p < end:
                return hit.num_tokens // p  # short: the request recomputes
            try:
                staging = self.staging(spec.num_pages)  # on vLLM's KV device: it may be full (no store failure)
            except (RuntimeError, MemoryError) as exc:
                logger.warning("kvstore handoff %s of request %s: no staging for %d pages: %s", spec.handoff_id, spec.req_id,
                               spec.num_pages, exc)
                return 0
            try:
                await client.get(Hit(hit.namespace_id, spec.num_pages * p, hit.keys[first:end], [], hit.generation), staging)
            except KVStoreError as exc:  # PageMissing, PageCorrupt: the leading pages before it are in place
                return first + int(getattr(exc, "num_tokens", 0)) // p
            got_all = first == 0 and hit.num_pages == end
            waiting.staging = staging
            return end
        finally:
            if not got_all:
                let_go(client, spec.handoff_id)

    def forget(self, req_ids: set[str]) -> None:
        """vLLM finished these requests (aborted while waiting): their receives end now, reported
        failed, so that vLLM frees their blocks, and nothing is written into them."""
        self._gone |= req_ids & {w.spec.req_id for w in self._waiting}

    def __len__(self) -> int:
        return len(self._waiting)

    def answered(self, idle: bool) -> list[Answered]:
        """The receives that ended (or were given up on, past their wait + ``GRACE_S``, or whose
        request went). ``idle``: the step computed nothing, so it waits ``IDLE_WAIT_S`` at most for
        one first."""
        running = [w.job.result for w in self._waiting if w.job is not None and not w.job.result.done()]
        if idle and running:
            concurrent.futures.wait(running, IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED)
        now, out, still = time.monotonic(), [], []
        for waiting in self._waiting:
            gone = waiting.spec.req_id in self._gone
            if waiting.job is None and now < waiting.start_by and not gone:
                self._start(waiting, self.store.client(), waiting.start_by - now)
            if not gone and ((waiting.job is None and now < waiting.start_by)
                             or (waiting.job is not None and not waiting.job.result.done() and now <= waiting.give_up_at)):
                still.append(waiting)
            else:
                out.append(self._ended(waiting, gone))
        self._waiting = still
        self._gone.clear()
        return out

    def _ended(self, waiting: Waiting, gone: bool) -> Answered:
        spec, job = waiting.spec, waiting.job
        if job is None:
            return Answered(spec, 0, None, "the store could not be reached")
        result = job.result
        if not result.done():
            job.cancel()  # it writes only into its own staging tensor
            why = "its request went" if gone else f"no marker or pages within {spec.handoff_wait_s:.1f} s (+{GRACE_S:.0f} s)"
            return Answered(spec, 0, None, why)
        if result.cancelled() or result.exception() is not None:
            exc = None if result.cancelled() else result.exception()
            if isinstance(exc, KVStoreError) and waiting.client is not None:  # a transport failure drops the client
                self.store.failed(waiting.client, exc)
            return Answered(spec, 0, None, f"the receive failed: {exc!r}")
        return Answered(spec, 0 if gone else int(result.result()), waiting.staging,
                        "its request went" if gone else "the handoff held fewer pages (missing, foreign, expired or damaged)")

    def shutdown(self) -> None:
        for waiting in self._waiting:
            if waiting.job is not None and not waiting.job.result.done():
                waiting.job.cancel()
        self._waiting = []
