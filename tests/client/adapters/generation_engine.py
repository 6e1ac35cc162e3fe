"""vLLM's engine loop over the connector's parts, without an engine: the scheduler side with its
handoffs, the worker side with its handoff worker, called in connector.py's hook order (one
``step``: the scheduler's output, the forward pass, the finished reports and the workers' report
back). The forward pass writes into each token row it computes the request's ``tag``: which
request computed it, in which generation (DESIGN §3), so a loaded page says whose KV it is."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from kvstore import KVLayout, Namespace
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.metadata import KVStoreConnectorMetadata, KVStoreWorkerMetadata
from kvstore.client.adapters.vllm.pd import HandoffScheduler
from kvstore.client.adapters.vllm.pd_worker import HandoffWorker
from kvstore.client.adapters.vllm.scheduler import SchedulerSide
from kvstore.client.adapters.vllm.worker import WorkerSide
from kvstore.security.credentials import Credentials

BLOCK, HEADS, DIM, LAYERS, NUM_BLOCKS = 32, 2, 8, 2, 96
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, page_tokens=BLOCK)
NAMES = [f"model.layers.{i}.attn" for i in range(LAYERS)]
REQUESTS_PER_GENERATION = 10_000  # a tag is generation * this + the request's number


def tag(generation: int, number: int) -> float:
    assert 0 < number < REQUESTS_PER_GENERATION
    return float(generation * REQUESTS_PER_GENERATION + number)


def generation_of(tag_value: float) -> int:
    return int(tag_value) // REQUESTS_PER_GENERATION


@dataclass
class Scheduled:
    """One request in a step: ``num_tokens`` computed from ``computed`` on; ``new``: its first
    step with these blocks (vLLM's scheduled_new_reqs)."""

    request: Any
    computed: int
    num_tokens: int
    tag: float
    new: bool


@dataclass
class StepResult:
    meta: KVStoreConnectorMetadata
    sending: set[str]  # finished_sending: the blocks of these finished requests are free
    recving: set[str]  # finished_recving: these decodes' handed-off pages landed
    load_errors: set[int] = field(default_factory=set)


class Engine:
    """One kv_both instance: a prefill's and a decode's requests go through the same parts."""

    def __init__(self, address: str, token: str, use_shm: bool) -> None:
        namespace = Namespace(model="generation-model", revision="r", layout=LAYOUT)
        self.store = StoreConnection(address, namespace, use_shm=use_shm, retry_s=0.2, credentials=Credentials(token))
        assert self.store.start(), "the connector did not connect"
        self.caches = {name: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM) for name in NAMES}  # vLLM's CPU layout
        self.scheduler = SchedulerSide(self.store, BLOCK, lookup_timeout_s=5.0, load_when_faster=False)
        self.handoffs = HandoffScheduler(self.scheduler, deadline_s=2.0, ttl_s=30.0)
        self.worker = WorkerSide(self.store, NAMES, BLOCK, NUM_BLOCKS, load_deadline_s=5.0)
        self.worker.register(self.caches)
        self.handoff_worker = HandoffWorker(self.store, BLOCK, open_timeout_s=5.0, complete_timeout_s=5.0)
        self.handoff_worker.register([self.caches[name] for name in NAMES])
        self.free = list(range(NUM_BLOCKS))
        self.blocks: dict[str, list[int]] = {}
        self._finished: set[str] = set()  # finished since the last step: the next get_finished's
        self._held: set[str] = set()  # finished, blocks kept until reported finished sending

    def matched(self, request: Any) -> tuple[int, bool]:
        """get_num_new_matched_tokens (vLLM's own prefix cache holds nothing: out of scope, DESIGN §3)."""
        handed = self.handoffs.matched(request, 0)
        return handed if handed is not None else (self.scheduler.num_new_matched_tokens(request, 0), False)

    def alloc(self, request: Any, num_tokens: int, num_external_tokens: int) -> None:
        """Allocates blocks for ``num_tokens`` (the prompt and every output token) and tells the connector."""
        blocks = [self.free.pop() for _ in range(-(-num_tokens // BLOCK))]
        self.blocks[request.request_id] = blocks
        if not self.handoffs.after_alloc(request, SimpleNamespace(get_block_ids=lambda: (blocks,)), num_external_tokens):
            self.scheduler.after_alloc(request, num_external_tokens)

    def finish(self, request: Any, status: str = "FINISHED_LENGTH_CAPPED") -> dict[str, Any] | None:
        """request_finished: the blocks go back now, or once the workers report the request."""
        request.status = SimpleNamespace(name=status)
        held, params = self.handoffs.finished(request, self.scheduler.finished(request))
        self._finished.add(request.request_id)
        if held:
            self._held.add(request.request_id)
        else:
            self.free += self.blocks.pop(request.request_id)
        return params

    @property
    def holds_blocks(self) -> bool:
        return bool(self._held) or self.scheduler.holds_blocks or self.handoffs.holds_blocks

    def step(self, scheduled: list[Scheduled]) -> StepResult:
        new = [s for s in scheduled if s.new]
        cached = [s for s in scheduled if not s.new]
        out = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=s.request.request_id, block_ids=(self.blocks[s.request.request_id],),
                                                num_computed_tokens=s.computed) for s in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[s.request.request_id for s in cached], resumed_req_ids=set(),
                                                  new_block_ids=[None] * len(cached),
                                                  num_computed_tokens=[s.computed for s in cached]),
            num_scheduled_tokens={s.request.request_id: s.num_tokens for s in scheduled}, preempted_req_ids=None)
        meta = self.handoffs.add_to(self.scheduler.build_meta(out))
        finished, self._finished = self._finished, set()
        self.handoff_worker.begin_step(meta)  # bind_connector_metadata
        self.worker.begin_step(meta)
        self.worker.start_loads(meta)
        for name in NAMES:
            self.worker.wait_layer(name)
            for s in scheduled:
                self._compute(s, name)
            self.worker.save_layer(name)
        self.worker.end_step()
        saved = self.worker.finished(finished)  # get_finished
        sending, recving = self.handoff_worker.finished(saved, finished)
        errors = self.worker.load_errors() | self.handoff_worker.load_errors()
        report = self.worker.report()
        short = self.handoff_worker.take_short()
        if short:
            report = report if report is not None else KVStoreWorkerMetadata()
            report.stored_pages.update(short)
        self.scheduler.saves_finished(sending)  # update_connector_output
        self.handoffs.sent(sending)
        self.scheduler.saves_short(report)
        self.scheduler.measured(report)
        for req_id in sending & self._held:
            self._held.discard(req_id)
            self.free += self.blocks.pop(req_id)
        return StepResult(meta, sending, recving, errors)

    def _compute(self, s: Scheduled, name: str) -> None:
        """The forward pass of one layer: ``s.tag`` into the rows of the tokens it computes."""
        blocks, cache = self.blocks[s.request.request_id], self.caches[name]
        t, end = s.computed, s.computed + s.num_tokens
        while t < end:
            row_end = min(end, (t // BLOCK + 1) * BLOCK)
            cache[blocks[t // BLOCK], :, t % BLOCK : t % BLOCK + row_end - t, :] = s.tag
            t = row_end

    def tags(self, req_id: str, first_page: int, num_pages: int) -> set[float]:
        """The tags in a request's blocks of pages [first_page, first_page + num_pages), every layer."""
        blocks = self.blocks[req_id][first_page : first_page + num_pages]
        return {float(v) for name in NAMES for v in self.caches[name][blocks].unique().tolist()}

    def close(self) -> None:
        self.worker.shutdown()
        self.handoff_worker.shutdown()
        self.store.close()
