"""Worker side of the connector for hybrid engines (several KV cache groups, or a window
group: groups.py, hybrid_scheduler.py).

More: client/adapters/vllm/README.md (### hybrid_worker.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.costs import MIN_DEADLINE_S, StepClock
from kvstore.client.adapters.vllm.grouped import GroupedBlocks
from kvstore.client.adapters.vllm.hybrid_handoff import HybridReceives
from kvstore.client.adapters.vllm.hybrid_states import StateBlocks, state_key
from kvstore.client.adapters.vllm.layout import block_views
from kvstore.client.adapters.vllm.metadata import GroupLoad, GroupSave, KVStoreConnectorMetadata, KVStoreWorkerMetadata
from kvstore.client.adapters.vllm.worker import WorkerStats
from kvstore.client.client import Hit, KVStoreClient
from kvstore.errors import InvalidRequest, KVStoreError, StaleGeneration

logger = logging.getLogger(__name__)


@dataclass
class HybridWorkerStats(WorkerStats):
    null_slices_skipped: int = 0  # (page, layer) slices of loads not written: a null block, outside a window
    states_loaded: int = 0  # loads that wrote the states after their last page
    states_saved: int = 0  # boundaries whose states were stored


@dataclass
class PendingSave:
    spec: GroupSave
    client: KVStoreClient
    job: Any  # the runtime's Job of the put: ``job.result`` is a concurrent Future of the tokens stored
    num_pages: int  # 0: the states after the save's last page (counted in states_saved when stored)


@dataclass
class HybridWorkerSide:
    store: StoreConnection
    layer_names: list[str]
    layer_groups: list[int]
    block_size: int
    load_deadline_s: float | None = None
    states: StoreConnection | None = None  # the state namespace's connection, with state-space groups
    state_layer_names: list[str] = field(default_factory=list)
    state_layer_groups: list[int] = field(default_factory=list)
    stats: HybridWorkerStats = field(default_factory=HybridWorkerStats)

    def __post_init__(self) -> None:
        self.layout = self.store.namespace.layout
        self._grouped: GroupedBlocks | None = None
        self._states: StateBlocks | None = None
        self._saves: list[GroupSave] = []  # this step's, copied out in end_step
        self._pending: list[PendingSave] = []  # puts running in the background
        self._loaded: set[str] = set()  # this step's loads that landed whole
        self._failed: set[str] = set()  # this step's loads that did not
        self._short: dict[str, int] = {}  # req id -> leading pages stored at most, after a save that ended short
        self._stale: set[str] = set()  # requests a save of which was refused as stale, since the last report
        self.clock = StepClock()  # forward passes and load stalls, for the scheduler side's cost model
        self._loads_ok, self._stretch = True, 1.0  # this step's loads, for the clock (worker.py's end_step)
        self.receives = HybridReceives(self.store, lambda n: self._blocks().staging(n))  # decodes' handoffs
        self._idle = False  # this step computes nothing

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = [kv_caches[name] for name in self.layer_names]
        blocks, _ = block_views(tensors, self.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        self._grouped = GroupedBlocks(blocks, self.layer_groups, self.layout)
        if self.states is not None:
            self._states = StateBlocks([kv_caches[name] for name in self.state_layer_names], self.state_layer_groups,
                                       self.states.namespace.layout)

    def _blocks(self) -> GroupedBlocks:
        assert self._grouped is not None, "register_kv_caches was not called"
        return self._grouped

    # -- one step ------------------------------------------------------------------------

    def begin_step(self, meta: KVStoreConnectorMetadata) -> None:
        loads = sum(spec.num_pages for spec in meta.group_loads if not spec.handoff_id)  # a handoff's: in a later step
        self.clock.begin(meta.num_prefill_tokens, loads * self.layout.page_bytes)
        self._saves = list(meta.group_saves)
        self._idle = meta.num_scheduled_tokens == 0

    def start_loads(self, meta: KVStoreConnectorMetadata) -> None:
        since = time.perf_counter()
        client = self.store.client()
        self._loads_ok = client is not None or not meta.group_loads  # a load that could not start measures nothing
        for spec in meta.group_loads:
            if spec.handoff_id:
                self.receives.start(client, spec)  # lands in transfer_results once its marker answered
                continue
            ok, stretch = self._load(client, spec) if client is not None else (False, 1.0)
            self._stretch = max(self._stretch, stretch)
            (self._loaded if ok else self._failed).add(spec.req_id)
            if ok:
                self.stats.loaded_tokens += spec.num_pages * self.layout.page_tokens
            else:
                self.stats.failed_loads += 1
            if client is not None and spec.lease is not None and client.namespace.namespace_id == spec.namespace_id:
                self.store.release(client, spec.lease.lease_id)  # the load leases the pages itself
        self.clock.stalled(since)

    def _load(self, client: KVStoreClient, spec: GroupLoad) -> tuple[bool, float]:
        """Fetches the pages (a layer-wise load, bounded by the deadline) and the states
        after the last one into staging tensors, then writes them into the blocks. Returns
        whether it landed (nothing is written when any of it is missing, corrupt or late),
        and how many times longer the whole would have taken than the stall (a load cut at
        its deadline: its pages over those received, for the clock)."""
        p, num_layers = self.layout.page_tokens, self.layout.num_layers
        all_keys = client.keys(spec.tokens)
        keys = all_keys[spec.first_page : spec.first_page + spec.num_pages]
        if len(keys) < spec.num_pages or spec.num_pages <= 0 or (self._states is not None and not spec.state_blocks):
            logger.warning("kvstore load of request %s has no pages or no block for its states; it recomputes", spec.req_id)
            return False, 1.0
        # the configured deadline, else the scheduler side's (from the measured recompute cost), else the client's prior
        deadline_s = self.load_deadline_s if self.load_deadline_s is not None else spec.deadline_s
        if deadline_s is None:
            deadline_s = max(MIN_DEADLINE_S, 2 * len(keys) * p / client.prefill_tokens_per_s)
        ends = time.monotonic() + deadline_s
        staging = self._blocks().staging(len(keys))
        try:
            load = client.load(Hit(client.namespace.namespace_id, len(keys) * p, keys, []), into=staging, ahead=num_layers,
                               deadline_s=deadline_s)
        except (KVStoreError, AttributeError, ValueError) as exc:  # the client closed under us
            logger.warning("kvstore load of request %s not started, it recomputes from its start: %s", spec.req_id, exc)
            return False, 1.0
        if not all(load.wait(layer) for layer in range(num_layers)) or load.num_tokens < len(keys) * p:
            load.abandon("not complete by its deadline")
            logger.warning("kvstore load of request %s not whole in time (%d of %d pages received); it recomputes from its "
                           "start", spec.req_id, load.pages_received, len(keys))
            if load.error is not None:
                self.store.failed(client, load.error)
            return False, len(keys) / max(1, min(len(keys), load.pages_received))
        return self._write(spec, staging, all_keys[-1], max(MIN_DEADLINE_S, ends - time.monotonic())), 1.0

    def _fetch_states(self, last_page_key: bytes, generation: int, timeout_s: float) -> torch.Tensor:
        """The states after the page ``last_page_key``, verified (KVStoreError if absent or
        not in within ``timeout_s``: what is left of the load's deadline, no sign of a broken
        connection)."""
        assert self.states is not None and self._states is not None
        client = self.states.client()
        if client is None:
            raise KVStoreError("the state namespace's store cannot be reached")
        key = state_key(last_page_key, client.namespace.namespace_id, generation)
        staging = self._states.staging()
        try:
            self.states.run(client, client.get(Hit(client.namespace.namespace_id, 1, [key], []), staging), timeout_s)
        except (KVStoreError, TimeoutError) as exc:
            if not isinstance(exc, (InvalidRequest, TimeoutError)):
                self.states.failed(client, exc)
            raise KVStoreError(f"the states after the last page did not load: {exc}") from exc
        return staging

    def wait_layer(self, layer_name: str) -> None:
        """Nothing: a hybrid engine's loads landed before the request computes."""

    def save_layer(self, layer_name: str) -> None:
        """Nothing: saves copy every layer out when the step ends."""

    def end_step(self) -> None:
        """Ends the step's timing; copies this step's saves out of vLLM's blocks and starts
        storing them."""
        self.clock.end(loads_ok=self._loads_ok, stretch=self._stretch)
        self._loads_ok, self._stretch = True, 1.0
        client = self.store.client()
        for spec in self._saves:
            num_pages = len(spec.tokens) // self.layout.page_tokens - spec.first_page
            if spec.state_blocks:
                self._save_states(spec)
            if num_pages <= 0:
                continue
            if client is None:
                self._stored_short(spec.req_id, spec.first_page)
                continue
            try:
                staging = self._blocks().gather(spec.block_ids, spec.first_page, num_pages)
                keys = client.keys(spec.tokens)[spec.first_page :]
                job = client.runtime.submit(client.put_keys(keys, staging, generation=spec.generation))  # refused once invalidated
            except KVStoreError as exc:
                logger.warning("kvstore save of request %s not started: %s", spec.req_id, exc)
                self.stats.saves_failed += 1
                self._stored_short(spec.req_id, spec.first_page)
                continue
            self._pending.append(PendingSave(spec, client, job, num_pages))
            self.stats.saves_started += 1
        self._saves = []

    def _save_states(self, spec: GroupSave) -> None:
        """Copies the states after the save's last page out and starts storing them."""
        pages_client, client = self.store.client(), self.states.client() if self.states is not None else None
        if pages_client is None or client is None or self._states is None:
            return  # a cache: this boundary is just not a hit later
        try:
            staging = self._states.gather(dict(spec.state_blocks))
            key = state_key(pages_client.keys(spec.tokens)[-1], client.namespace.namespace_id, spec.generation or 0)
            job = client.runtime.submit(client.put_keys([key], staging))
        except KVStoreError as exc:
            logger.warning("kvstore: the states of request %s were not saved: %s", spec.req_id, exc)
            return
        self._pending.append(PendingSave(spec, client, job, 0))

    def _collect(self) -> None:
        """Counts the puts that ended since the last call."""
        still = []
        for save in self._pending:
            if not save.job.result.done():
                still.append(save)
                continue
            spec, stored = save.spec, 0
            try:
                stored = save.job.result.result() // save.client.layout.page_tokens
            except StaleGeneration:  # invalidated since its lookup (DESIGN §3): its later pages would be refused too
                self.stats.saves_stale += 1
                self._stale.add(spec.req_id)
                continue
            except (KVStoreError, concurrent.futures.CancelledError) as exc:
                self.stats.saves_failed += 1
                logger.warning("kvstore save of request %s failed: %s", spec.req_id, exc)
                if isinstance(exc, KVStoreError):
                    (self.states if save.num_pages == 0 and self.states is not None else self.store).failed(save.client, exc)
            if save.num_pages == 0:  # the states: nothing to save again (a later boundary will be)
                self.stats.states_saved += stored
                continue
            self.stats.saved_tokens += stored * self.layout.page_tokens
            if stored < save.num_pages:
                self._stored_short(spec.req_id, spec.first_page + stored)
        self._pending = still

    def _stored_short(self, req_id: str, pages: int) -> None:
        self._short[req_id] = min(self._short.get(req_id, pages), pages)

    # -- after the step ------------------------------------------------------------------

    def transfer_results(self, finished_req_ids: set[str] | None = None) -> tuple[set[str], set[str]]:
        """This step's loads: (landed whole or failed, failed). vLLM takes a failed one as
        finished too, and recomputes it. ``finished_req_ids``: vLLM's, of this step (a decode
        aborted while its handoff is received is reported now: vLLM frees its blocks then)."""
        self.receives.forget(finished_req_ids or set())
        self._land_handoffs()
        done, failed = self._loaded | self._failed, self._failed
        self._loaded, self._failed = set(), set()
        return done, failed

    def _land_handoffs(self) -> None:
        """Writes the handoffs received whole into the requests' blocks, with the states after
        their last page (between steps: vLLM holds the request, its blocks allocated); the others
        are failed, and recompute."""
        for answer in self.receives.answered(self._idle):
            spec, p = answer.spec, self.layout.page_tokens
            ok = answer.num_pages >= spec.first_page + spec.num_pages and answer.staging is not None
            if not ok:
                logger.warning("kvstore handoff %s of request %s: %d of %d pages received (%s); it recomputes from its start",
                               spec.handoff_id, spec.req_id, answer.num_pages, spec.first_page + spec.num_pages, answer.reason)
            else:
                client = self.store.client()
                last = client.keys(spec.tokens)[-1] if client is not None and self._states is not None else None
                deadline_s = self.load_deadline_s if self.load_deadline_s is not None else spec.deadline_s
                ok = self._write(spec, answer.staging, last, max(MIN_DEADLINE_S, deadline_s or MIN_DEADLINE_S))
            (self._loaded if ok else self._failed).add(spec.req_id)
            if ok:
                self.stats.loaded_tokens += spec.num_pages * p
            else:
                self.stats.failed_loads += 1

    def _write(self, spec: GroupLoad, staging: torch.Tensor, last_key: bytes | None, timeout_s: float) -> bool:
        """Writes a load's pages (``staging``) and, with state-space groups, the states after its
        last page (``last_key``'s, fetched now within ``timeout_s``) into the blocks; False, writing
        nothing, when the states are not to be had or a page lies past the blocks (InvalidRequest)."""
        try:
            states = None
            if self._states is not None:
                if last_key is None or not spec.state_blocks:
                    raise KVStoreError("no store to key the states by, or no block for them")
                states = self._fetch_states(last_key, spec.generation, timeout_s)
            self.stats.null_slices_skipped += self._blocks().scatter(staging, spec.block_ids, spec.first_page)
        except KVStoreError as exc:
            logger.warning("kvstore load of request %s failed, it recomputes from its start: %s", spec.req_id, exc)
            return False
        if states is not None:
            assert self._states is not None
            self._states.scatter(states, dict(spec.state_blocks))
            self.stats.states_loaded += 1
        return True

    def saving(self) -> set[str]:
        """Requests with a put still running (a handoff completes once its request's ended)."""
        self._collect()
        return {save.spec.req_id for save in self._pending}

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """No request's blocks are held (saves read copies), so none is reported here."""
        self._collect()
        return set()

    def load_errors(self) -> set[int]:
        return set()  # failed loads are whole requests (transfer_results), never blocks

    def report(self) -> KVStoreWorkerMetadata | None:
        """Requests whose saves ended short, and the steps and loads timed, since the last report."""
        self._collect()
        steps, loads = self.clock.take()
        if not (self._short or steps or loads or self._stale):
            return None
        report = KVStoreWorkerMetadata(self._short, steps, loads, stale=self._stale)
        self._short, self._stale = {}, set()
        return report

    def wait_saves(self, timeout_s: float) -> bool:
        """Waits for every put started so far to end; False on timeout."""
        deadline = time.monotonic() + timeout_s
        for save in list(self._pending):
            try:
                save.job.result.exception(max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                return False
            except concurrent.futures.CancelledError:
                pass
        self._collect()
        return True

    def preempted(self, req_ids: set[str]) -> None:
        """Nothing: no save reads vLLM's blocks after its step."""

    def shutdown(self) -> None:
        self.receives.shutdown()
        for save in self._pending:
            save.job.cancel()
