"""Scheduler side of the connector for hybrid engines (several KV cache groups, or a
window group: groups.py).

It differs from the single-group side (scheduler.py) in three ways:

* A hit is loaded before the request computes, not inside its first step: vLLM cannot be
  told which blocks of which group failed to load (its block-level error report is
  refused for several groups), only that a request's load failed, and only for a load it
  waits for (``load_kv_async``). So a hit is offered as an asynchronous load; the
  workers copy it whole in the step that carries it and report it finished, or failed:
  then vLLM recomputes the request from its start, and this side offers it no hit again.
* Blocks come per group (``update_state_after_alloc``: the request's block table of every
  group, vLLM's null blocks included), and a save takes the request's current tables from
  vLLM's cache manager: a window group's blocks are dropped as the window moves on.
  Pages are saved only up to the first page that has a dropped block in some group
  (grouped.pages_with_data); the pages after it would be unreachable (only a contiguous
  prefix counts), so the request saves nothing more.
* Saves are copied out of vLLM's blocks when the step ends (grouped.py), so a finished
  request's blocks are never held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.grouped import pages_with_data
from kvstore.client.adapters.vllm.metadata import GroupLoad, GroupSave, KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.scheduler import RequestState, SchedulerSide

logger = logging.getLogger(__name__)

BlockTables = Callable[[str], tuple[list[int], ...]]  # a request's current block table of every group


class HybridSchedulerSide(SchedulerSide):
    """See the module docstring. ``block_tables``: vLLM's cache manager's current block
    ids of a request (null blocks included)."""

    def __init__(self, store: StoreConnection, block_size: int, lookup_timeout_s: float, block_tables: BlockTables,
                 load_when_faster: bool = True) -> None:
        super().__init__(store, block_size, lookup_timeout_s, load_when_faster)
        self.block_tables = block_tables
        self._group_ids: dict[str, tuple[list[int], ...]] = {}  # blocks of a due load, as allocated
        self._no_more_saves: set[str] = set()  # a page with a dropped block ended the request's saves

    def after_alloc(self, request: Any, num_external_tokens: int, blocks: Any = None) -> None:
        super().after_alloc(request, num_external_tokens)
        if num_external_tokens > 0 and blocks is not None and request.request_id in self._requests:
            self._group_ids[request.request_id] = tuple(list(ids) for ids in blocks.get_block_ids())

    def build_meta(self, out: Any) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(preempted=set(out.preempted_req_ids or ()),
                                        num_scheduled_tokens=sum(out.num_scheduled_tokens.values()))
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

    def _plan_load(self, meta: KVStoreConnectorMetadata, req_id: str, state: RequestState) -> None:
        state.load_due = False
        block_ids = self._group_ids.pop(req_id, None)
        if block_ids is None:  # no blocks were given (cannot happen with a load due): no load, the request waits none
            logger.error("kvstore: request %s has a load due but no blocks", req_id)
            return
        p = self.page_tokens
        first = state.load_from // p
        leased_in = state.lease.namespace_id if state.lease is not None else b""
        meta.group_loads.append(GroupLoad(req_id, state.tokens[: state.hit_tokens], block_ids, first,
                                          state.hit_tokens // p - first, leased_in, state.lease))
        state.lease = None  # the worker gives it back

    def _plan_save(self, meta: KVStoreConnectorMetadata, req_id: str, computed_after: int) -> None:
        """Saves the full pages computed by the end of this step that kvstore lacks, up to
        the first page with a dropped block in some group."""
        state = self._requests[req_id]
        p = self.page_tokens
        known = len(state.request.all_token_ids) if state.tokens else 0
        end = min(computed_after, known) // p
        if end <= state.stored_pages or req_id in self._no_more_saves or self.store.client() is None:
            return
        block_ids = self.block_tables(req_id)
        usable = pages_with_data(block_ids, self.block_size, p, state.stored_pages, end)
        if usable < end:
            self._no_more_saves.add(req_id)
            logger.info("kvstore: request %s saves no page from %d on: vLLM dropped a block of it (outside a window)",
                        req_id, usable)
        if usable > state.stored_pages:
            meta.group_saves.append(GroupSave(req_id, list(state.request.all_token_ids[: usable * p]),
                                              tuple(list(ids) for ids in block_ids), state.stored_pages))
            state.stored_pages = usable

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
        self._no_more_saves.discard(request.request_id)
        return False
