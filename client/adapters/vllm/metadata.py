"""What the scheduler side tells the workers each step, and what the workers tell it back
(plain data: vLLM may pickle it between processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvstore.client.adapters.connection import ArenaLease


@dataclass(frozen=True)
class LoadSpec:
    """Load pages ``[first_page, first_page + num_pages)`` of the prefix ``tokens`` into
    the request's blocks. Workers compute the keys in their own namespace (their TP shard).
    ``lease``: the scheduler's lookup leased the prefix in ``namespace_id``; the worker of
    that namespace may copy straight from it, and gives it back either way. ``deadline_s``:
    the most the load may hold up the step (from the measured cost of recomputing it),
    unless the connector's configuration sets one."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    first_page: int
    num_pages: int
    namespace_id: bytes = b""
    lease: ArenaLease | None = None
    deadline_s: float | None = None


@dataclass(frozen=True)
class SaveSpec:
    """Save the full pages ``[first_page, len(tokens) / page_tokens)`` of ``tokens`` (prompt
    and generated tokens whose KV exists by the end of this step) from the request's blocks,
    layer by layer during this step's forward pass. ``session_id``: the request's session
    (sessions.py), named so that a fence refuses the save."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    first_page: int
    session_id: str = ""
    generation: int | None = None  # the namespace's the KV was computed in (scheduler.py's RequestState)


@dataclass(frozen=True)
class GroupLoad:
    """A hybrid engine's load (grouped.py): pages ``[first_page, first_page + num_pages)``
    of ``tokens`` into the request's blocks of every KV cache group (``block_ids[g]``:
    group g's block table, null blocks included). All of it lands, or the request is
    reported failed and recomputes from its start: a hit covers every group or none.
    ``state_blocks``: (group, block) of each state-space group, where the state after the
    last page goes (hybrid_states.py). ``deadline_s``: as LoadSpec's. ``handoff_id``: a
    decode's handoff (pd.py): its marker is waited for (at most ``handoff_wait_s``) and its
    pages got in the background, then written between steps (hybrid_handoff.py)."""

    req_id: str
    tokens: list[int]
    block_ids: tuple[list[int], ...]
    first_page: int
    num_pages: int
    namespace_id: bytes = b""
    lease: ArenaLease | None = None
    state_blocks: tuple[tuple[int, int], ...] = ()
    generation: int = 0  # of the pages' namespace at the lookup: part of the states' key
    deadline_s: float | None = None
    handoff_id: str = ""
    handoff_wait_s: float = 0.0


@dataclass(frozen=True)
class GroupSave:
    """A hybrid engine's save: the pages ``[first_page, len(tokens) / page_tokens)``,
    copied out of every group's blocks when the step ends; with ``state_blocks`` ((group,
    block) of each state-space group) also the states after the last page."""

    req_id: str
    tokens: list[int]
    block_ids: tuple[list[int], ...]
    first_page: int
    state_blocks: tuple[tuple[int, int], ...] = ()
    # of the pages' namespace at the request's lookup (None: none learned): its page puts name it, and the
    # states' key holds it (0 for None)
    generation: int | None = None


@dataclass(frozen=True)
class HandoffOpen:
    """Prefill side (pd.py): open handoff ``handoff_id`` before the request's saves start,
    so that the pages of ``tokens`` (the prompt's full pages) are pushed to ``to_node`` (a
    kvstore node id; None: through the pool) as they are published."""

    req_id: str
    handoff_id: str
    to_node: str | None
    ttl_s: float
    tokens: list[int]


@dataclass(frozen=True)
class HandoffComplete:
    """Prefill side: once the request's saves ended, report it finished sending and mark the
    handoff complete for the full pages of ``tokens`` (the prompt's computed pages)."""

    req_id: str
    handoff_id: str
    to_node: str | None
    tokens: list[int]


@dataclass(frozen=True)
class HandoffLoad:
    """Decode side: wait (at most ``deadline_s``) for handoff ``handoff_id``'s completion
    marker for the pages of ``tokens`` (the prompt up to the hit), then load pages
    ``[first_page, first_page + num_pages)`` of them into the request's blocks in the
    background; vLLM holds the request until it is reported finished receiving (pages that
    did not come: failed blocks, recomputed)."""

    req_id: str
    handoff_id: str
    tokens: list[int]
    block_ids: list[int]
    first_page: int
    num_pages: int
    deadline_s: float


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    group_loads: list[GroupLoad] = field(default_factory=list)  # hybrid engines only, as group_saves
    group_saves: list[GroupSave] = field(default_factory=list)
    num_scheduled_tokens: int = 0  # of the step
    num_prefill_tokens: int = 0  # of the step's requests in their prompt: what a forward pass without loads is timed against
    handoff_opens: list[HandoffOpen] = field(default_factory=list)  # disaggregated prefill (pd.py)
    handoff_completes: list[HandoffComplete] = field(default_factory=list)
    handoff_loads: list[HandoffLoad] = field(default_factory=list)
    handoff_declines: list[str] = field(default_factory=list)  # decode side: handoff ids it takes nothing of


@dataclass
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Requests whose saves stored less than the scheduler side counted (a save failed, was
    cancelled or could not start), each with the leading pages of the request that may be
    stored at most: the scheduler side saves again from there. And what the workers
    measured for the cost model (costs.py): ``step_costs`` (prefill tokens, seconds) of
    forward passes without loads, ``load_costs`` (bytes, seconds the step waited) of loads.
    ``fenced``: requests whose save a fence refused (their session moved: sessions.py);
    ``stale``: requests whose save was refused as stale (invalidated since their lookup, DESIGN
    §3): every later page of theirs names the same generation, and none is sent."""

    stored_pages: dict[str, int] = field(default_factory=dict)
    step_costs: list[tuple[int, float]] = field(default_factory=list)
    load_costs: list[tuple[int, float]] = field(default_factory=list)
    fenced: set[str] = field(default_factory=set)
    stale: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVStoreWorkerMetadata:
        """Tensor-parallel workers each report their shard: a page counts only if every shard
        stored it; every shard's measurements count."""
        merged = dict(self.stored_pages)
        for req_id, pages in getattr(other, "stored_pages", {}).items():
            merged[req_id] = min(merged.get(req_id, pages), pages)
        return KVStoreWorkerMetadata(merged, self.step_costs + list(getattr(other, "step_costs", [])),
                                     self.load_costs + list(getattr(other, "load_costs", [])),
                                     self.fenced | set(getattr(other, "fenced", ())),
                                     self.stale | set(getattr(other, "stale", ())))
