"""Scheduler side of the connector: how much of a prompt kvstore holds, and which pages
each step loads and saves.

More: client/adapters/vllm/README.md (### scheduler.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvstore.client.adapters.connection import ArenaLease, StoreConnection
from kvstore.client.adapters.vllm.costs import LoadPolicy, prefill_tokens
from kvstore.client.adapters.vllm.metadata import KVStoreConnectorMetadata, KVStoreWorkerMetadata, LoadSpec, SaveSpec
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """What the scheduler side knows of one request."""

    request: Any  # vLLM's request: all_token_ids grows with the generated tokens
    tokens: list[int]  # the prompt
    stored_pages: int  # leading pages kvstore holds (lookup) or will hold (saves scheduled)
    hit_tokens: int  # what may be loaded: block-aligned, short of the last prompt token
    block_ids: list[int] = field(default_factory=list)
    load_from: int = 0  # tokens; a load of [load_from, hit_tokens) is due when load_from < hit_tokens
    load_due: bool = False
    saving: bool = False  # a save was scheduled: the blocks are kept until the workers finish it
    lease: ArenaLease | None = None  # held until a load takes it over or the request goes
    session_id: str = ""  # its saves name it (sessions.py): a fence refuses them
    fenced: bool = False  # its session moved: nothing more is saved
    stale: bool = False  # a save was refused as stale (invalidated since its lookup): nothing more is saved
    # the namespace generation its KV is computed in: its lookup's, else the highest its client saw
    # before it came; its saves name it, so an invalidation acknowledged since refuses them (DESIGN §3)
    generation: int | None = None


def step_meta(out: Any) -> KVStoreConnectorMetadata:
    """A step's metadata before its loads and saves: what the step schedules (``out``: vLLM's
    SchedulerOutput) and the requests it preempted."""
    return KVStoreConnectorMetadata(preempted=set(out.preempted_req_ids or ()),
                                    num_scheduled_tokens=sum(out.num_scheduled_tokens.values()),
                                    num_prefill_tokens=prefill_tokens(out))


class SchedulerSide:
    def __init__(self, store: StoreConnection, block_size: int, lookup_timeout_s: float, load_when_faster: bool = True) -> None:
        self.store = store
        self.block_size = block_size
        self.page_tokens = store.namespace.layout.page_tokens
        self.lookup_timeout_s = lookup_timeout_s
        self._requests: dict[str, RequestState] = {}
        self._held: set[str] = set()  # finished requests whose blocks vLLM keeps until the saves end
        self.policy = LoadPolicy(store.namespace.layout.bytes_per_token, enabled=load_when_faster)

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own block-aligned hit) that kvstore
        can supply and that are worth loading: 0 on a miss, a timeout, a store that cannot be
        reached, or a hit measured to load slower than it recomputes."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = self._lookup(request)
            found = max(0, state.hit_tokens - num_computed_tokens)
            if self.policy.decide(self.store.client(), request.request_id, found) < found:
                state.hit_tokens = min(state.hit_tokens, num_computed_tokens)  # recomputed (a lease goes back at alloc)
        return max(0, state.hit_tokens - num_computed_tokens)

    @property
    def requests(self) -> dict[str, RequestState]:
        return self._requests

    def adopt(self, state: RequestState) -> None:
        """Tracks a request whose KV comes another way (a decode's handoff, pd.py): it saves
        from page ``state.stored_pages`` on, and loads nothing itself."""
        self._requests[state.request.request_id] = state

    def _lookup(self, request: Any) -> RequestState:
        tokens = list(request.prompt_token_ids or ())
        stored, lease = 0, None
        client = self.store.client()
        generation = self.store.generation_seen()  # where no answer names one (the store away, a lookup that failed)
        if client is not None and len(tokens) <= self.page_tokens:
            generation = self.store.probe_generation(client, self.lookup_timeout_s)  # no page to look up
        elif client is not None:
            if client.shared_memory:
                lease = self.store.acquire(client, client.keys(tokens), self.lookup_timeout_s)
                stored = lease.num_pages if lease is not None else 0
                generation = lease.generation if lease is not None else generation
                lease = lease if stored else None
            else:
                try:
                    hit = self.store.run(client, client.lookup(tokens), self.lookup_timeout_s)
                    stored, generation = hit.num_pages, hit.generation
                except (KVStoreError, TimeoutError) as exc:
                    self.store.failed(client, exc)
        usable = min(stored * self.page_tokens, len(tokens) - 1)
        return RequestState(request, tokens, stored, usable - usable % self.block_size, lease=lease, generation=generation)

    def generation_now(self) -> int | None:
        """What a request that learns no generation of its own computes in (a decode's, a short
        prompt's): the namespace's now, asked; else the highest an answer named so far (a lower
        bound of the current one: an invalidation since refuses its saves). None where none was
        ever named (a token without the read right: its saves are in the server's current one)."""
        client = self.store.client()
        return self.store.probe_generation(client, self.lookup_timeout_s) if client is not None else self.store.generation_seen()

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if num_external_tokens > 0:
            state.load_from = state.hit_tokens - num_external_tokens
            state.load_due = True
            self.policy.loaded(num_external_tokens)
        else:
            self._release(state)  # vLLM's own cache covers it, or the request skips caches

    def _release(self, state: RequestState) -> None:
        client = self.store.client()
        if state.lease is not None and client is not None:
            self.store.release(client, state.lease.lease_id)
        state.lease = None

    def build_meta(self, out: Any) -> KVStoreConnectorMetadata:
        meta = step_meta(out)
        for new in out.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan(meta, new.req_id, state, new.num_computed_tokens + out.num_scheduled_tokens[new.req_id])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(blocks[0]) if blocks is not None else []
            elif blocks is not None:
                state.block_ids.extend(blocks[0])
            self._plan(meta, req_id, state, cached.num_computed_tokens[i] + out.num_scheduled_tokens[req_id])
        return meta

    def _plan(self, meta: KVStoreConnectorMetadata, req_id: str, state: RequestState, computed_after: int) -> None:
        """Adds this step's load and save of one request to ``meta``."""
        p = self.page_tokens
        if state.load_due:
            state.load_due = False
            first = state.load_from // p
            leased_in = state.lease.namespace_id if state.lease is not None else b""  # salted: the client's, not the config's
            num_pages = state.hit_tokens // p - first
            meta.loads.append(LoadSpec(req_id, state.tokens[: state.hit_tokens], state.block_ids, first, num_pages, leased_in,
                                       state.lease, self.policy.deadline_s(num_pages * p)))
            state.lease = None  # the worker gives it back
        # Token ids known now (with async scheduling the last sampled one may come later):
        # nothing when the prompt came as embeddings (no ids to key pages by).
        known = len(state.request.all_token_ids) if state.tokens else 0
        end = min(computed_after, known) // p
        if end > state.stored_pages and not state.fenced and not state.stale and self.store.client() is not None:
            num_blocks = -(-end * p // self.block_size)
            tokens = list(state.request.all_token_ids[: end * p])
            meta.saves.append(SaveSpec(req_id, tokens, state.block_ids[:num_blocks], state.stored_pages, state.session_id,
                                       state.generation))
            state.stored_pages = end
            state.saving = True

    def finished(self, request: Any) -> bool:
        """True when a save of this request may still read its blocks: vLLM keeps them
        until a worker reports the request in ``finished_sending``."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False
        self._release(state)
        if not state.saving:
            return False
        self._held.add(request.request_id)
        return True

    def saves_finished(self, req_ids: set[str]) -> None:
        self._held -= req_ids

    def saves_short(self, report: KVStoreWorkerMetadata | None) -> None:
        """Takes back the pages counted for saves that stored less (the workers' report):
        the request's next step saves again from the pages that may be stored. A request a
        save of which was refused as stale saves nothing more (its pages name that generation)."""
        if report is None:
            return
        for req_id in report.stale:
            if (stale := self._requests.get(req_id)) is not None:
                stale.stale = True
        for req_id, pages in report.stored_pages.items():
            state = self._requests.get(req_id)
            if state is not None and pages < state.stored_pages:
                logger.info("kvstore: request %s has %d pages stored, not %d; saving the rest again",
                            req_id, pages, state.stored_pages)
                state.stored_pages = pages

    def measured(self, report: KVStoreWorkerMetadata | None) -> None:
        """Feeds what the workers measured this step (forward passes, loads) to the cost model."""
        if report is not None:
            self.policy.measured(report.step_costs, report.load_costs)

    @property
    def holds_blocks(self) -> bool:
        """Blocks of finished requests are still held: vLLM may wait for them rather than
        preempt, and its engine loop keeps stepping until they are given back."""
        return bool(self._held)
