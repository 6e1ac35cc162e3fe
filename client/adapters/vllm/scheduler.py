"""Scheduler side of the connector: how much of a prompt kvstore holds, and which pages
each step loads and saves.

Per request, one lookup (the answer is cached, so vLLM may ask again and get the same
count). The count offered to vLLM is aligned to vLLM blocks and kvstore pages and leaves
at least the prompt's last token to compute, so the engine always has logits to sample.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvstore.client.adapters.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.client.adapters.connection import StoreConnection
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """What the scheduler side knows of one request."""

    tokens: list[int]
    stored_pages: int  # leading pages kvstore holds (lookup) or will hold (saves scheduled)
    hit_tokens: int  # what may be loaded: block-aligned, short of the last prompt token
    block_ids: list[int] = field(default_factory=list)
    load_from: int = 0  # tokens; a load of [load_from, hit_tokens) is due when load_from < hit_tokens
    load_due: bool = False
    saving: bool = False  # a save was scheduled: the blocks are kept until the workers finish it


class SchedulerSide:
    def __init__(self, store: StoreConnection, block_size: int, lookup_timeout_s: float) -> None:
        self.store = store
        self.block_size = block_size
        self.page_tokens = store.namespace.layout.page_tokens
        self.lookup_timeout_s = lookup_timeout_s
        self._requests: dict[str, RequestState] = {}

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own block-aligned hit) that kvstore
        can supply: 0 on a miss, a timeout or a store that cannot be reached."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = self._lookup(request)
        return max(0, state.hit_tokens - num_computed_tokens)

    def _lookup(self, request: Any) -> RequestState:
        tokens = list(request.prompt_token_ids or ())
        stored = 0
        client = self.store.client()
        if client is not None and len(tokens) > self.page_tokens:
            try:
                hit = self.store.run(client.lookup(tokens), self.lookup_timeout_s)
                stored = hit.num_pages
            except (KVStoreError, TimeoutError) as exc:
                self.store.failed(client, exc)
        usable = min(stored * self.page_tokens, len(tokens) - 1)
        return RequestState(tokens, stored, usable - usable % self.block_size)

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is not None and num_external_tokens > 0:
            state.load_from = state.hit_tokens - num_external_tokens
            state.load_due = True

    def build_meta(self, out: Any) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(preempted=set(out.preempted_req_ids or ()))
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
            meta.loads.append(LoadSpec(req_id, state.tokens[: state.hit_tokens], state.block_ids, first,
                                       state.hit_tokens // p - first))
        end = min(computed_after, len(state.tokens)) // p
        if end > state.stored_pages:
            num_blocks = -(-end * p // self.block_size)
            meta.saves.append(SaveSpec(req_id, state.tokens[: end * p], state.block_ids[:num_blocks], state.stored_pages))
            state.stored_pages = end
            state.saving = True

    def finished(self, request: Any) -> bool:
        """True when a save of this request may still read its blocks: vLLM keeps them
        until a worker reports the request in ``finished_sending``."""
        state = self._requests.pop(request.request_id, None)
        return state is not None and state.saving
