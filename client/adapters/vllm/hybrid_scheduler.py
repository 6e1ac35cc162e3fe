"""Scheduler side of the connector for hybrid engines (several KV cache groups, or a
window group: groups.py).

More: client/adapters/vllm/README.md (### hybrid_scheduler.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.grouped import pages_with_data
from kvstore.client.adapters.vllm.groups import NULL_BLOCK, KVGroups
from kvstore.client.adapters.vllm.hybrid_states import state_block, state_key
from kvstore.client.adapters.vllm.metadata import GroupLoad, GroupSave, KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.scheduler import RequestState, SchedulerSide, step_meta
from kvstore.errors import InvalidRequest, KVStoreError

logger = logging.getLogger(__name__)

BlockTables = Callable[[str], tuple[list[int], ...]]  # a request's current block table of every group
STATE_PROBES = 4  # boundaries, from the end of the stored pages back, whose states a lookup asks for


class HybridSchedulerSide(SchedulerSide):
    """See the module docstring. ``block_tables``: vLLM's cache manager's current block
    ids of a request (null blocks included). ``states``: the connection to the state
    namespace, with state-space groups."""

    def __init__(self, store: StoreConnection, groups: KVGroups, lookup_timeout_s: float, block_tables: BlockTables,
                 load_when_faster: bool = True, states: StoreConnection | None = None) -> None:
        super().__init__(store, groups.spec.block_size, lookup_timeout_s, load_when_faster)
        self.groups = groups
        self.block_tables = block_tables
        self.states = states
        self._attention = [group.index for group in groups.groups]
        self._group_ids: dict[str, tuple[list[int], ...]] = {}  # blocks of a due load, as allocated
        self._no_more_saves: set[str] = set()  # a page with a dropped block ended the request's saves
        self._state_saved: dict[str, int] = {}  # req id -> the last boundary (tokens) whose states were saved
        self._generations: dict[str, int | None] = {}  # req id -> the pages' namespace generation its lookup saw
        self._handoffs: dict[str, tuple[str, float]] = {}  # a decode's load: its handoff id and wait deadline (pd.py)

    def _lookup(self, request: Any) -> RequestState:
        """The stored pages (no lease: the workers fetch them whole), and with state-space
        groups the last boundary before their end whose states are stored."""
        tokens = list(request.prompt_token_ids or ())
        p, stored = self.page_tokens, 0
        client = self.store.client()
        generation = self.store.generation_seen()  # where no answer names one; the saves name it (as scheduler.py's)
        if client is not None and len(tokens) <= p:
            generation = self.store.probe_generation(client, self.lookup_timeout_s)  # no page to look up
        elif client is not None:
            try:
                if self.groups.state_groups:
                    hit = self.store.run(client, client.lookup_keys(client.keys(tokens)), self.lookup_timeout_s)
                    stored, generation = hit.num_pages, hit.generation
                else:
                    stored, generation = self.store.stored_prefix(client, client.keys(tokens), self.lookup_timeout_s)
            except (KVStoreError, TimeoutError) as exc:
                self.store.failed(client, exc)
        self._generations[request.request_id] = generation
        usable = min(stored * p, len(tokens) - 1)
        usable -= usable % self.block_size
        if self.groups.state_groups and usable:
            usable = self._stored_state(client, tokens, usable // p, generation or 0) * p
        return RequestState(request, tokens, stored, usable, generation=generation)

    def _stored_state(self, pages_client: Any, tokens: list[int], pages: int, generation: int) -> int:
        """The last of the ``STATE_PROBES`` boundaries up to ``pages`` whose states are
        stored (in pages), 0 if none is."""
        states = self.states
        client = states.client() if states is not None else None
        if states is None or client is None:
            return 0
        keys = pages_client.keys(tokens[: pages * self.page_tokens])
        for end in range(pages, max(0, pages - STATE_PROBES), -1):
            if (end * self.page_tokens) % self.block_size:
                continue
            try:
                key = state_key(keys[end - 1], client.namespace.namespace_id, generation)
                found = states.num_stored(client, [key], self.lookup_timeout_s)
            except (KVStoreError, TimeoutError) as exc:
                states.failed(client, exc)
                return 0
            if found:
                return end
        return 0

    def after_alloc(self, request: Any, num_external_tokens: int, blocks: Any = None) -> None:
        super().after_alloc(request, num_external_tokens)
        if num_external_tokens > 0 and blocks is not None and request.request_id in self._requests:
            self._group_ids[request.request_id] = tuple(list(ids) for ids in blocks.get_block_ids())

    def handoff_load(self, state: RequestState, handoff_id: str, deadline_s: float, blocks: Any,
                     num_external_tokens: int) -> None:
        """A decode's handed-off pages (pd.py): loaded like a hit, after the handoff's marker,
        and saved from their end on; ``state.generation``: the prefill's (the states' key)."""
        req_id = state.request.request_id
        state.load_from, state.load_due = state.hit_tokens - num_external_tokens, True
        self.adopt(state)
        self._group_ids[req_id] = tuple(list(ids) for ids in blocks.get_block_ids())
        self._generations[req_id] = state.generation
        self._handoffs[req_id] = (handoff_id, deadline_s)

    def handoff_limit(self, req_id: str) -> int:
        """The most tokens a finished prefill hands off (pd.py): its pages saved (a page with a
        block vLLM dropped, outside a window, ended its saves), and with state-space groups no
        page past the last boundary whose states it saved (a decode resumes only there)."""
        state = self._requests.get(req_id)
        limit = state.stored_pages * self.page_tokens if state is not None else 0
        return min(limit, self._state_saved.get(req_id, 0)) if self.groups.state_groups else limit

    def build_meta(self, out: Any) -> KVStoreConnectorMetadata:
        meta = step_meta(out)
        for req_id, state in self._requests.items():
            if state.load_due:  # waiting for its load (not scheduled): the workers load it this step
                self._plan_load(meta, req_id, state)
        for new in out.scheduled_new_reqs:
            if new.req_id in self._requests:
                self._plan_save(meta, new.req_id, new.num_computed_tokens + out.num_scheduled_tokens[new.req_id])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._requests:
                self._plan_save(meta, req_id, cached.num_computed_tokens[i] + out.num_scheduled_tokens[req_id])
        return meta

    def _states_at(self, block_ids: tuple[list[int], ...], boundary: int) -> tuple[tuple[int, int], ...] | None:
        """(group, block) holding each state group's state after token ``boundary``; None
        when one is not held (a null block)."""
        try:
            found = tuple((g.index, state_block(block_ids[g.index], boundary, g.block_size)) for g in self.groups.state_groups)
        except InvalidRequest:
            return None
        return None if any(block == NULL_BLOCK for _, block in found) else found

    def _plan_load(self, meta: KVStoreConnectorMetadata, req_id: str, state: RequestState) -> None:
        state.load_due = False
        block_ids = self._group_ids.pop(req_id, None)
        p = self.page_tokens
        states: tuple[tuple[int, int], ...] | None = ()
        if block_ids is not None and self.groups.state_groups:
            states = self._states_at(block_ids, state.hit_tokens)
        if block_ids is None or states is None:  # no blocks for it: the request gets the load reported failed
            logger.error("kvstore: request %s has a load due but no blocks for it", req_id)
            block_ids, states = tuple([] for _ in range(len(self.groups.groups) + len(self.groups.state_groups))), ()
        first, num_pages = state.load_from // p, state.hit_tokens // p - state.load_from // p
        handoff_id, wait_s = self._handoffs.pop(req_id, None) or ("", 0.0)
        meta.group_loads.append(GroupLoad(req_id, state.tokens[: state.hit_tokens], block_ids, first, num_pages,
                                          state_blocks=states, generation=self._generations.get(req_id) or 0,
                                          deadline_s=self.policy.deadline_s(num_pages * p), handoff_id=handoff_id,
                                          handoff_wait_s=wait_s))
        self._release(state)  # a hybrid lookup leases nothing; a lease taken otherwise goes back

    def _plan_save(self, meta: KVStoreConnectorMetadata, req_id: str, computed_after: int) -> None:
        """Saves the full pages computed by the end of this step that kvstore lacks, up to
        the first page with a dropped block in an attention group, and the states when the
        step ends at a page boundary."""
        state = self._requests[req_id]
        p = self.page_tokens
        known = len(state.request.all_token_ids) if state.tokens else 0
        end = min(computed_after, known) // p
        wants_states = (bool(self.groups.state_groups) and computed_after % p == 0 and 0 < computed_after <= known
                        and self._state_saved.get(req_id) != computed_after)
        if (end <= state.stored_pages and not wants_states) or req_id in self._no_more_saves or state.stale \
                or self.store.client() is None:
            return
        block_ids = self.block_tables(req_id)
        first = state.stored_pages
        usable = pages_with_data([block_ids[g] for g in self._attention], self.block_size, p, first, max(first, end))
        if usable < end:
            self._no_more_saves.add(req_id)
            logger.info("kvstore: request %s saves no page from %d on: vLLM dropped a block of it (outside a window)",
                        req_id, usable)
        states: tuple[tuple[int, int], ...] | None = ()
        if wants_states and usable * p >= computed_after:
            states = self._states_at(block_ids, computed_after) or ()
            if states:
                self._state_saved[req_id] = computed_after
        if usable > first or states:
            last = computed_after // p if states else usable
            meta.group_saves.append(GroupSave(req_id, list(state.request.all_token_ids[: last * p]),
                                              tuple(list(ids) for ids in block_ids), first, states,
                                              self._generations.get(req_id)))
            state.stored_pages = max(first, usable)

    def loads_failed(self, req_ids: set[str]) -> None:
        """The workers could not load these requests' hits: vLLM recomputes them from their
        start and asks for a hit again, which is then none."""
        for req_id in req_ids:
            state = self._requests.get(req_id)
            if state is not None:
                logger.warning("kvstore: the load of request %s failed; it recomputes from its start", req_id)
                state.hit_tokens = 0
                state.stored_pages = 0  # unknown which pages are intact: the request saves its pages again

    def finished(self, request: Any) -> bool:
        """False: saves never read vLLM's blocks after their step (they were copied out)."""
        super().finished(request)
        self._held.discard(request.request_id)
        self._group_ids.pop(request.request_id, None)
        self._handoffs.pop(request.request_id, None)
        self._no_more_saves.discard(request.request_id)
        self._state_saved.pop(request.request_id, None)
        self._generations.pop(request.request_id, None)
        return False
