"""Disaggregated prefill, scheduler side: a prefill instance hands a prompt's KV to a
decode instance through kvstore, as vLLM's own PD connectors (NixlConnector, Mooncake) do
it, with the roles chosen per request by ``kv_transfer_params`` (both instances run
``kv_role: kv_both``; kvstore-pd-proxy sets the parameters).

More: client/adapters/vllm/README.md (### pd.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from kvstore.client.adapters.vllm.hybrid_scheduler import HybridSchedulerSide
from kvstore.client.adapters.vllm.metadata import HandoffComplete, HandoffLoad, HandoffOpen, KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.pd_jobs import let_go
from kvstore.client.adapters.vllm.scheduler import RequestState, SchedulerSide
from kvstore.client.handoff import new_handoff_id

logger = logging.getLogger(__name__)

MAX_DEADLINE_S = 600.0  # a handoff wait's longest at the node (its MAX_TTL_S)
FINISHED_NORMALLY = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")  # vLLM's RequestStatus names


@dataclass
class Prefill:
    handoff_id: str
    to_node: str | None
    opened: bool = False
    generation: int | None = None  # its lookup's (RequestState.generation), handed to the decode side


@dataclass
class Decode:
    handoff_id: str
    handed_tokens: int  # the prompt's leading tokens the prefill handed off (whole pages)
    hit_tokens: int  # of those, what is offered: block-aligned, short of the prompt's last token
    deadline_s: float
    consumed: bool = False  # its load was planned (or it needs none): never offered again
    generation: int | None = None  # the prefill's (kvstore_generation), when it named one


def _generation(req_id: str, named: object) -> int | None:
    """A decode's ``kvstore_generation``: a generation (an int >= 0), else none (logged when it is
    malformed). A wrong one refuses only this request's saves: a put names, never raises, one."""
    if named is None or named == "":
        return None
    if type(named) is int and 0 <= named < 1 << 63:
        return named
    logger.error("kvstore: request %s has kvstore_generation %.40r, not a generation: its saves name the store's", req_id, named)
    return None


def _node(req_id: str, node: object) -> str | None:
    """A prefill's ``kvstore_decode_node``: a node id, else through the pool (None)."""
    if node is None or node == "":
        return None
    if not isinstance(node, str):
        logger.error("kvstore: request %s has kvstore_decode_node %.40r, not a node id: handed off through the pool",
                     req_id, node)
        return None
    return node


class HandoffScheduler:
    """The scheduler side's handoffs; wraps the scheduler side (a hybrid engine's too: its
    decode loads every group once the marker answered, hybrid_handoff.py). ``deadline_s``:
    how long a decode waits for a marker unless the request's ``kvstore_deadline_s`` says
    otherwise; ``ttl_s``: how long an open handoff lives at the store unless completed and
    consumed."""

    def __init__(self, scheduler: SchedulerSide, deadline_s: float, ttl_s: float) -> None:
        self.scheduler = scheduler
        self.page_tokens = scheduler.page_tokens
        self.block_size = scheduler.block_size
        self.deadline_s = deadline_s
        self.ttl_s = ttl_s
        self._prefills: dict[str, Prefill] = {}
        self._decodes: dict[str, Decode] = {}
        self._held: set[str] = set()  # prefill requests whose blocks wait for their handoff to complete
        self._opens: list[HandoffOpen] = []
        self._completes: list[HandoffComplete] = []
        self._loads: list[HandoffLoad] = []
        self._declines: list[str] = []  # handoff ids the workers of ranks > 0 decline in theirs (HandoffWorker.begin_step)
        hybrid = scheduler if isinstance(scheduler, HybridSchedulerSide) else None
        self._hybrid = hybrid
        self._states_at_boundary = hybrid is not None and bool(hybrid.groups.state_groups)

    # -- both roles ----------------------------------------------------------------------

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool] | None:
        """The answer to ``get_num_new_matched_tokens`` for a decode side's request: the
        handed-off tokens past ``num_computed_tokens``, loaded asynchronously; None for a
        request without a handoff to receive (a prefill's goes on as any request)."""
        params = request.kv_transfer_params or {}
        req_id = request.request_id
        if params.get("do_remote_decode") and req_id not in self._prefills:
            self._prefills[req_id] = Prefill(new_handoff_id(), _node(req_id, params.get("kvstore_decode_node")))
        decode = self._decodes.get(req_id)
        if decode is None and params.get("do_remote_prefill") and params.get("kvstore_handoff_id"):
            try:
                decode = self._decodes[req_id] = self._decode(request, params)
            except (TypeError, ValueError, OverflowError) as exc:  # the request's sender's: never raised into vLLM
                logger.error("kvstore: request %s names a handoff with kvstore_num_tokens %.40r: %s; served as any request",
                             req_id, params.get("kvstore_num_tokens"), exc)
                return None
            if decode.handed_tokens and not decode.hit_tokens:
                self._decline(decode)
        if decode is None:
            return None
        found = 0 if decode.consumed else max(0, decode.hit_tokens - num_computed_tokens)
        return found, found > 0

    def _decode(self, request: Any, params: dict[str, Any]) -> Decode:
        prompt = len(request.prompt_token_ids or ())
        p = self.page_tokens
        handed = min(int(params.get("kvstore_num_tokens") or 0), prompt) // p * p
        hit = min(handed, prompt - 1)
        hit -= hit % self.block_size
        if self._states_at_boundary and hit != handed:
            hit = 0  # state-space groups: the prefill saved the states after its last handed page only
        return Decode(str(params["kvstore_handoff_id"]), handed, hit, self._deadline(request.request_id, params),
                      generation=_generation(request.request_id, params.get("kvstore_generation")))

    def _decline(self, decode: Decode) -> None:
        """A handoff this decode takes nothing of (a state-space model's, its hit short of the states'
        boundary; one vLLM's own cache covers; a request gone before it was scheduled): its node
        lets go of the pages at once, not at the ttl (``let_go``). This side's namespace is rank 0's:
        with tensor parallelism each rank's shard has a marker of its own (DESIGN §12.7), which the
        other ranks' workers decline with the next step's metadata."""
        client = self.scheduler.store.client()
        if client is not None:
            let_go(client, decode.handoff_id)
        self._declines.append(decode.handoff_id)

    def _generation_of(self, decode: Decode) -> int | None:
        """A decode's saves name the generation the prefill computed in (its kv_transfer_params'
        ``kvstore_generation``), else the namespace's when its load is planned: an invalidation
        after refuses the saves of KV computed on the handoff's pages."""
        return decode.generation if decode.generation is not None else self.scheduler.generation_now()

    def _deadline(self, req_id: str, params: dict[str, Any]) -> float:
        """The request's ``kvstore_deadline_s``: the configured one unless it is a finite number above
        0 (a sender's mistake is logged), and at most a handoff's longest wait."""
        asked = params.get("kvstore_deadline_s")
        if not asked:
            return self.deadline_s
        try:
            deadline = float(asked)
        except (TypeError, ValueError):
            deadline = math.nan
        if not (math.isfinite(deadline) and deadline > 0):
            logger.error("kvstore: request %s has kvstore_deadline_s %.40r, not a number of seconds above 0: %.1f s instead",
                         req_id, asked, self.deadline_s)
            return self.deadline_s
        return min(deadline, MAX_DEADLINE_S)

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> bool:
        """Plans a decode's load or opens a prefill's handoff; True when the request is a
        decode's (the single-group side must not plan a load of its own for it)."""
        req_id = request.request_id
        prefill = self._prefills.get(req_id)
        if prefill is not None and not prefill.opened:
            prefill.opened = True
            state = self.scheduler.requests.get(req_id)
            prefill.generation = state.generation if state is not None else None
            prompt = list(request.prompt_token_ids or ())
            # state-space groups: which pages are of use is known at the end (handoff_limit), so they go
            # to the decode node at Complete, not as stored (else a decode node would hold pages nobody takes)
            to_node = None if self._states_at_boundary else prefill.to_node
            self._opens.append(HandoffOpen(req_id, prefill.handoff_id, to_node, self.ttl_s,
                                           prompt[: len(prompt) // self.page_tokens * self.page_tokens]))
        decode = self._decodes.get(req_id)
        if decode is None:
            return False
        if num_external_tokens > 0 and not decode.consumed and self._hybrid is not None:
            self._hybrid.handoff_load(RequestState(request, list(request.prompt_token_ids), decode.hit_tokens // self.page_tokens,
                                                   decode.hit_tokens, generation=self._generation_of(decode)),
                                      decode.handoff_id, decode.deadline_s, blocks, num_external_tokens)
        elif num_external_tokens > 0 and not decode.consumed:
            p = self.page_tokens
            first = (decode.hit_tokens - num_external_tokens) // p
            tokens = list(request.prompt_token_ids[: decode.hit_tokens])
            self._loads.append(HandoffLoad(req_id, decode.handoff_id, tokens, list(blocks.get_block_ids()[0]), first,
                                           decode.hit_tokens // p - first, decode.deadline_s))
            # its pages are at the store: the request saves from its next page on
            self.scheduler.adopt(RequestState(request, list(request.prompt_token_ids), decode.hit_tokens // p,
                                              decode.hit_tokens, generation=self._generation_of(decode)))
        else:  # vLLM's own cache covers it (or a load was planned for it before): saves as any request
            if not decode.consumed and decode.hit_tokens:  # it loads nothing: let go (a hit of 0 was declined already)
                self._decline(decode)
            if req_id not in self.scheduler.requests:
                self.scheduler.adopt(RequestState(request, list(request.prompt_token_ids or ()), 0, 0,
                                                  generation=self._generation_of(decode)))
        decode.consumed = True
        if request.kv_transfer_params:
            request.kv_transfer_params["do_remote_prefill"] = False  # one transfer per request, as vLLM's connectors
        return True

    def add_to(self, meta: KVStoreConnectorMetadata) -> KVStoreConnectorMetadata:
        meta.handoff_opens, self._opens = self._opens, []
        meta.handoff_completes, self._completes = self._completes, []
        meta.handoff_loads, self._loads = self._loads, []
        meta.handoff_declines, self._declines = self._declines, []
        return meta

    def finished(self, request: Any, saving: bool, limit: int | None = None) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``: a prefill that ran to its end keeps its blocks until its
        saves ended (the workers then report it finished sending and complete the handoff)
        and returns what the decode side needs; ``saving``: the single-group side holds them
        for its saves; ``limit``: a hybrid engine's most tokens to hand off
        (HybridSchedulerSide.handoff_limit)."""
        req_id = request.request_id
        decode = self._decodes.pop(req_id, None)
        if decode is not None and not decode.consumed and decode.hit_tokens:  # gone before it was scheduled: let go
            self._decline(decode)
        prefill = self._prefills.pop(req_id, None)
        if prefill is None or not prefill.opened or getattr(request.status, "name", "") not in FINISHED_NORMALLY:
            return saving, None  # aborted, or never scheduled: an open handoff expires after its TTL
        p = self.page_tokens
        prompt = list(request.prompt_token_ids or ())
        handed = min(request.num_computed_tokens, len(prompt)) // p * p
        if limit is not None:  # a hybrid engine's: the pages it saved, up to its states' boundary
            handed = min(handed, limit)
        self._completes.append(HandoffComplete(req_id, prefill.handoff_id, prefill.to_node, prompt[:handed]))
        self._held.add(req_id)
        client = self.scheduler.store.client()
        generation = prefill.generation
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, "kvstore_handoff_id": prefill.handoff_id,
            "kvstore_prefill_node": client.node if client is not None else "",
            "kvstore_decode_node": prefill.to_node, "kvstore_num_tokens": handed,
            **({"kvstore_generation": generation} if generation is not None else {}),
        }

    def sent(self, req_ids: set[str]) -> None:
        self._held -= req_ids

    @property
    def holds_blocks(self) -> bool:
        return bool(self._held)
