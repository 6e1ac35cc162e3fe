"""Disaggregated prefill, worker side (pd.py is the scheduler side).

More: client/adapters/vllm/README.md (### pd_worker.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.layout import block_views
from kvstore.client.adapters.vllm.metadata import HandoffComplete, HandoffOpen, KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.pd_jobs import Completing, FailedJob, HandoffStats, Opening, Receiving, ended, let_go
from kvstore.client.adapters.vllm.pd_receives import GRACE_S, ReceiveSide
from kvstore.client.client import KVStoreClient
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)

# A step that computed nothing (every request waits for its KV, or holds its blocks for a
# completion) waits this long at most for a receive or completion to end, the GIL released:
# vLLM's loop spins through such steps, and the client's I/O thread, which takes the node's
# answers, got the GIL only at the 5 ms switch interval (6-64 ms from the node's answer to the
# worker's in kvstore-bench pd, on both sides).
IDLE_WAIT_S = 0.002


@dataclass
class HandoffWorker(ReceiveSide):
    """``blocks``: vLLM's KV per layer as ``[blocks, 2, block, heads, dim]`` (as worker.py
    views it, from ``register``); ``open_timeout_s``: the most a handoff's completion waits
    for its open to answer (the step never waits for it); ``complete_timeout_s``: for a
    completion's answer."""

    store: StoreConnection
    block_size: int
    open_timeout_s: float
    complete_timeout_s: float
    push_layers: bool | None = True  # the saves say each layer: the prefill node pushes it while later ones compute
    # (None: decided at register, True for KV on an accelerator: on the CPU the pushes take the prefill's cores)
    blocks: list[torch.Tensor] = field(default_factory=list)
    all_layers: torch.Tensor | None = None
    stats: HandoffStats = field(default_factory=HandoffStats)

    def __post_init__(self) -> None:
        self.layout = self.store.namespace.layout
        self._handed: dict[str, HandoffOpen] = {}  # prefill requests with an open handoff
        self._saving: set[str] = set()  # of those, with saves the single-group worker has not reported ended
        self._opening: dict[str, Opening] = {}  # prefill req id -> its handoff_open, not answered yet
        self._completing: dict[str, Completing] = {}
        self._receiving: list[Receiving] = []
        self._failed_blocks: set[int] = set()
        self._short: dict[str, int] = {}  # decode req id -> leading pages in its blocks, after a short receive
        self._idle = False  # this step computes nothing
        self._ending = threading.Condition()  # notified as each completion is counted
        self._in_flight = 0  # completions started and not counted yet (they end on the runtime's thread)

    def register(self, kv_caches: list[torch.Tensor]) -> None:
        """vLLM's KV of every layer, in page order (views of it, as worker.py takes them)."""
        self.blocks, self.all_layers = block_views(kv_caches, self.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        if self.push_layers is None and kv_caches:
            self.push_layers = kv_caches[0].device.type != "cpu"
            logger.info("handoff_push_layers auto: %s (vLLM's KV on %s)", self.push_layers, kv_caches[0].device)

    # -- each step -----------------------------------------------------------------------

    def begin_step(self, meta: KVStoreConnectorMetadata) -> None:
        """Opens this step's handoffs (before worker.py starts the saves), declines those the
        decode takes nothing of in this rank's namespace, and starts its receives."""
        client = self.store.client()
        self._idle = meta.num_scheduled_tokens == 0
        self._open(client, meta.handoff_opens)
        if client is not None and self.store.namespace.tp_rank > 0:  # rank 0's namespace is the scheduler side's: declined there
            for handoff_id in meta.handoff_declines:  # a Complete with no page at this node (pd.py _decline)
                let_go(client, handoff_id)
        self._saving |= {spec.req_id for spec in (*meta.saves, *meta.group_saves)} & self._handed.keys()
        for done in meta.handoff_completes:
            self._completing[done.req_id] = Completing(done)
        for load in meta.handoff_loads:
            self._receiving.append(self._receive(client, load))

    def _open(self, client: KVStoreClient | None, opens: list[HandoffOpen]) -> None:
        """Sends the handoffs' opens, all at once, without waiting: the step's forward pass
        runs beside them (waiting cost every handed-off prompt's TTFT an RPC, 0.7-8 ms in
        ``kvstore-bench pd`` on 2 busy cores, DESIGN §12.7). Pages stored before an open
        lands are pushed when it does; the completion waits for the open (``_settle_opens``).
        One not opened still hands off at Complete (its pages are pushed then, not as stored)."""
        self._handed.update((spec.req_id, spec) for spec in opens)
        if client is None:
            self.stats.open_failed += len(opens)
            return
        give_up_at = time.monotonic() + self.open_timeout_s
        for spec in opens:
            job = client.runtime.submit(client.handoff_open(spec.handoff_id, spec.to_node, ttl_s=spec.ttl_s, tokens=spec.tokens,
                                                            push_layers=self.push_layers is True))
            self._opening[spec.req_id] = Opening(spec, job, give_up_at, client)

    def _settle_opens(self, now: float) -> None:
        """Counts the opens that answered; one past ``open_timeout_s`` is given up on (cancelled)."""
        for req_id, opening in list(self._opening.items()):
            spec, result = opening.spec, opening.job.result
            if not result.done() and now <= opening.give_up_at:
                continue
            del self._opening[req_id]
            if result.done() and result.exception() is None:
                self.stats.opened += 1
            elif not result.done() or opening.given_up:  # its completion may have cancelled it: no transport failure
                if not result.done():
                    opening.job.cancel()
                self.stats.open_failed += 1
                logger.warning("kvstore handoff %s of request %s: no answer to its opening within %.2f s", spec.handoff_id,
                               spec.req_id, self.open_timeout_s)
            else:
                self.stats.open_failed += 1
                self._failed(opening.client, result.exception())
                logger.warning("kvstore handoff %s of request %s not opened: %s", spec.handoff_id, spec.req_id,
                               result.exception())

    # -- after the step ------------------------------------------------------------------

    def saving(self) -> set[str]:
        """Handed-off requests whose saves the workers have not reported ended."""
        return set(self._saving)

    def finished(self, saved: set[str], finished_req_ids: set[str],
                 saves_ended: set[str] | None = None) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) of this step. ``saves_ended``: the requests
        whose saves ended, ``saved`` when not given (a hybrid worker holds no blocks and
        reports none finished: its puts ended, hybrid_worker.py's ``saving``).
        ``saved``: what worker.py reported
        finished (its saves ended, short ones saved again: nothing reads its blocks after); a handed-off
        request among them is reported finished sending at once and completes in the background
        (after its open): held until Complete answered, its blocks were kept through the pushes in
        flight (~30 ms at 64 MiB) and an idle engine kept stepping. ``finished_req_ids``: vLLM's, of
        this step (one that ended without a complete to make, aborted, is forgotten: it expires)."""
        self._saving -= saved if saves_ended is None else saves_ended
        for req_id in finished_req_ids - self._completing.keys():  # aborted: nothing handed off
            spec = self._handed.pop(req_id, None)
            if spec is not None and spec.to_node:  # its pushed pages let go at the decode node now, not at the ttl
                self._abandon(spec, self._opening.get(req_id))
            self._opening.pop(req_id, None)
        running = [r.job.result for r in self._receiving if r.job is not None and not r.job.result.done()]
        running += [d.job.result for d in self._completing.values() if d.job is not None and not d.job.result.done()]
        running += [o.job.result for o in self._opening.values() if not o.job.result.done()]
        if self._idle and running:
            concurrent.futures.wait(running, IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED)
        now = time.monotonic()
        self._settle_opens(now)
        sending = saved - self._completing.keys()
        for req_id, done in list(self._completing.items()):
            if done.job is None and req_id not in self._saving:
                self._start_complete(done, now, self._opening.get(req_id))
                sending.add(req_id)
            if done.job is not None and (done.job.result.done() or now > done.give_up_at):
                if not done.job.result.done():
                    done.given_up = True  # before the cancel: its end, counted by _ended_complete, is no transport failure
                    done.job.cancel()
                del self._completing[req_id]
                self._handed.pop(req_id, None)
        return sending, self._settle_receives(now, finished_req_ids)

    def _start_complete(self, done: Completing, now: float, opening: Opening | None) -> None:
        """Completes in the background once the open answered (or was given up on: its pages go
        at Complete), so Complete never reaches the node first."""
        spec, client = done.spec, self.store.client()
        open_wait_s = max(0.0, opening.give_up_at - now) if opening is not None else 0.0
        done.give_up_at, done.client = now + open_wait_s + self.complete_timeout_s + GRACE_S, client
        if client is None:
            done.job = FailedJob()
            self._ended_complete(done)
            return
        coro = self._complete(client, spec, opening, open_wait_s)
        try:
            done.job = client.runtime.submit(coro)
        except KVStoreError as exc:  # its runtime closed under this step (the connection dropped it on another thread)
            coro.close()
            done.job = FailedJob(exc)
            self._ended_complete(done)
            return
        with self._ending:
            self._in_flight += 1
        # counted as it ends (on the runtime's thread): an engine with nothing else to do steps no more
        done.job.result.add_done_callback(lambda _: self._ended_complete(done, counted=True))

    async def _complete(self, client: KVStoreClient, spec: HandoffComplete, opening: Opening | None, open_wait_s: float) -> int:
        """However the open ends (answered, failed), the pages not pushed go at Complete. One that has
        not answered by ``open_timeout_s`` is cancelled and its unwinding waited for: still running, it
        could land after the Complete (a step's _settle_opens may never come: the engine went idle)."""
        if opening is not None and not (opened := opening.job.result).done():
            await ended(opened, open_wait_s)
            if not opened.done():
                opening.given_up = True  # before the cancel: _settle_opens counts it failed, the connection kept
                opening.job.cancel()
                await ended(opened, GRACE_S)
        return await client.handoff_complete(spec.handoff_id, spec.tokens, spec.to_node, deadline_s=self.complete_timeout_s)

    def _abandon(self, spec: HandoffOpen, opening: Opening | None) -> None:
        """Completes an aborted prefill's handoff with no page, in the background once its open
        answered (``_complete``): the decode node drops its marker and the pages pushed to it."""
        client = self.store.client()
        if client is None:
            return  # its pins go at the handoff's ttl
        open_wait_s = max(0.0, opening.give_up_at - time.monotonic()) if opening is not None else 0.0
        client.runtime.detach(self._complete(client, HandoffComplete(spec.req_id, spec.handoff_id, spec.to_node, []),
                                             opening, open_wait_s))

    def completions_in_flight(self) -> int:
        """Completions started whose end is not counted yet in ``stats``."""
        with self._ending:
            return self._in_flight

    def wait_completions(self, timeout_s: float) -> bool:
        """Waits until every completion started is counted in ``stats`` (they end in the background,
        after the request's blocks went back: harnesses that read the counters wait so, as worker.py's
        ``wait_saves``); False on timeout."""
        with self._ending:
            return self._ending.wait_for(lambda: self._in_flight == 0, timeout_s)

    def _ended_complete(self, done: Completing, counted: bool = False) -> None:
        with self._ending:  # counted on this thread and the runtimes' (a client dropped, its successor's)
            try:
                self._count_complete(done)
            finally:
                if counted:
                    self._in_flight -= 1
                    self._ending.notify_all()

    def _count_complete(self, done: Completing) -> None:
        spec, result = done.spec, done.job.result
        if not result.cancelled() and result.exception() is None:
            self.stats.completed += 1
            self.stats.completed_tokens += int(result.result())
        elif result.cancelled() or done.given_up:  # given up on past its deadline, or at shutdown: the runtime's
            # "cancelled" is a plain KVStoreError, which would drop the connection as a transport failure
            self.stats.complete_failed += 1
            logger.warning("kvstore handoff %s of request %s: no completion within %.1f s; the decode side recomputes",
                           spec.handoff_id, spec.req_id, self.complete_timeout_s)
        else:
            self.stats.complete_failed += 1
            self._failed(done.client, result.exception())
            logger.warning("kvstore handoff %s of request %s not completed: %s; the decode side recomputes",
                           spec.handoff_id, spec.req_id, result.exception())

    def shutdown(self) -> None:
        for rec in self._receiving:  # a job that ended is not cancelled: its client's runtime may have closed
            if rec.job is not None:
                if not rec.job.result.done():
                    rec.job.cancel()
                rec.job.result.add_done_callback(lambda _, rec=rec: self._give_back(rec, []))
        for done in self._completing.values():
            if done.job is not None and not done.job.result.done():
                done.given_up = True
                done.job.cancel()
        for opening in self._opening.values():
            if not opening.job.result.done():
                opening.job.cancel()
