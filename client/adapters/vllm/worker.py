"""Worker side of the connector: layer-wise loads into and saves out of vLLM's paged KV.

More: client/adapters/vllm/README.md (### worker.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.costs import StepClock
from kvstore.client.adapters.vllm.layout import RequestKV, block_views
from kvstore.client.adapters.vllm.leased_copy import copy_verified
from kvstore.client.adapters.vllm.metadata import KVStoreConnectorMetadata, KVStoreWorkerMetadata, LoadSpec, SaveSpec
from kvstore.client.adapters.vllm.resave import Unsaveds
from kvstore.client.arena import ArenaMap
from kvstore.client.client import Hit, KVStoreClient
from kvstore.client.layerwise import LayerLoad, LayerSave
from kvstore.device_ops import DeviceOps, ops_for
from kvstore.errors import KVStoreError, SessionFenced, StaleGeneration

logger = logging.getLogger(__name__)


@dataclass
class ActiveLoad:
    spec: LoadSpec
    kv: RequestKV
    load: LayerLoad | None  # None: copied at once (``copied``) or could not start (no store)
    client: KVStoreClient | None
    ok: bool = True  # every layer waited for so far arrived in time
    copied: int = 0  # valid pages of a load copied at once from the lookup's lease


@dataclass
class ActiveSave:
    spec: SaveSpec
    kv: RequestKV
    save: LayerSave
    marked: bool = False  # every layer handed over (end_step): the save ends on its own


@dataclass
class WorkerStats:
    """Counters tests and logs read (never reset)."""

    loaded_tokens: int = 0
    leased_copies: int = 0  # loads copied at once from the lookup's lease
    failed_loads: int = 0
    failed_blocks: int = 0
    saves_started: int = 0
    saves_again: int = 0  # saves of a finished request's unsaved pages (see resave)
    saves_cancelled: int = 0
    saves_failed: int = 0
    saves_fenced: int = 0  # refused: the request's session moved (live migration)
    saves_stale: int = 0  # refused: the generation the request names is not the namespace's (DESIGN §3)
    saved_tokens: int = 0


@dataclass
class WorkerSide:
    store: StoreConnection
    layer_names: list[str]
    block_size: int
    num_blocks: int
    load_deadline_s: float | None = None
    load_ahead: int | None = None
    sync_load_pages: int = 4
    stats: WorkerStats = field(default_factory=WorkerStats)
    # vLLM KV's device seam (kvstore.device_ops), read off the caches at register; tests give CpuOps to run it on CPU
    device_ops: DeviceOps | None = None

    def __post_init__(self) -> None:
        self.layout = self.store.namespace.layout
        self._layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self._blocks: list[torch.Tensor] = []
        self._all_layers: torch.Tensor | None = None
        self._loads: list[ActiveLoad] = []
        self._saves: list[ActiveSave] = []
        self._pending: dict[str, list[ActiveSave]] = {}  # req id -> saves not yet reported finished
        self._saving: set[str] = set()  # had a save scheduled: vLLM holds its blocks when it finishes
        self._finishing: set[str] = set()  # finished by vLLM, blocks held until its saves end
        self._failed_blocks: set[int] = set()
        self._short: dict[str, int] = {}  # req id -> leading pages stored at most, after a save that ended short
        self._stale: set[str] = set()  # requests a save of which was refused as stale, since the last report
        self._unsaved = Unsaveds(self.store.connect_timeout_s + self.store.retry_s)
        self.clock = StepClock()  # forward passes and load stalls, for the scheduler side's cost model

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = [kv_caches[name] for name in self.layer_names]
        self.device_ops = self.device_ops or ops_for(tensors[0].device)
        self._blocks, self._all_layers = block_views(tensors, self.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        if self._blocks[0].shape[0] != self.num_blocks:
            raise KVStoreError(f"vLLM KV cache has {self._blocks[0].shape[0]} kernel blocks for {self.num_blocks} "
                               "blocks; split kernel blocks are not supported by the kvstore connector")

    # -- one step ------------------------------------------------------------------------

    def begin_step(self, meta: KVStoreConnectorMetadata) -> None:
        """Starts this step's saves, so that their allocations overlap the forward pass."""
        self.clock.begin(meta.num_prefill_tokens, sum(spec.num_pages for spec in meta.loads) * self.layout.page_bytes)
        client = self.store.client()
        self._saving |= {spec.req_id for spec in meta.saves}
        started = [self._start_save(client, spec, computed=False) for spec in meta.saves]
        self._saves += [active for active in started if active is not None]

    def _start_save(self, client: KVStoreClient | None, spec: SaveSpec, computed: bool) -> ActiveSave | None:
        """Starts a layer-wise save of ``spec`` (``computed``: every layer of its blocks is
        computed already, as for a finished request: all are handed over at once); None
        when it could not start (then it counts as ended short)."""
        if client is None:
            self._stored_short(spec, spec.first_page)  # no store: nothing saved, nothing to wait for
            return None
        try:
            kv = RequestKV(self._blocks, spec.block_ids, 0, len(spec.tokens) // self.layout.page_tokens, self.layout,
                           guarded=not computed)
            save = client.save(spec.tokens, kv, start=spec.first_page * self.layout.page_tokens, session_id=spec.session_id,
                               generation=spec.generation)
        except KVStoreError as exc:  # a cache: this prefix is just not stored
            logger.warning("kvstore save of request %s not started: %s", spec.req_id, exc)
            self.stats.saves_failed += 1
            self._stored_short(spec, spec.first_page)
            return None
        active = ActiveSave(spec, kv, save)
        if computed:
            save.mark_all()
            active.marked = True
        self._pending.setdefault(spec.req_id, []).append(active)
        self.stats.saves_started += 1
        return active

    def start_loads(self, meta: KVStoreConnectorMetadata) -> None:
        """Small hits leased by the scheduler's lookup are copied here, at once (no RPC);
        others start a layer-wise load that ``wait_layer`` waits on."""
        since = time.perf_counter()
        client = self.store.client()
        for spec in meta.loads:
            kv = RequestKV(self._blocks, spec.block_ids, spec.first_page, spec.num_pages, self.layout,
                           all_layers=self._all_layers)
            ours = client is not None and spec.lease is not None and client.namespace.namespace_id == spec.namespace_id
            failed: list[bytes] = []  # a leased page whose copy failed its checksum: named at release
            try:
                if ours and spec.num_pages <= self.sync_load_pages and self._lease_usable(client, spec):
                    copied, corrupt = self._copy_leased(client, spec, kv)
                    self._loads.append(ActiveLoad(spec, kv, None, client, copied=copied))
                    self.stats.leased_copies += 1
                    failed = client.keys(spec.tokens)[spec.first_page + copied :][:1] if corrupt else []
                else:
                    self._loads.append(self._start_layerwise(client, spec, kv))
            except (KVStoreError, AttributeError, ValueError) as exc:  # the client closed under us: recompute
                logger.warning("kvstore load of request %s not started: %s", spec.req_id, exc)
                self._loads.append(ActiveLoad(spec, kv, None, client, ok=False))
            if ours:
                # failed: the server checks it and quarantines it at its source (server/placement/reported.py);
                # a page read up from disk is checked first here (DESIGN §4)
                self.store.release(client, spec.lease.lease_id, failed)  # type: ignore[arg-type,union-attr]
        self.clock.stalled(since)

    def _start_layerwise(self, client: KVStoreClient | None, spec: LoadSpec, kv: RequestKV) -> ActiveLoad:
        if client is None:
            return ActiveLoad(spec, kv, None, client, ok=False)
        keys = client.keys(spec.tokens)[spec.first_page : spec.first_page + spec.num_pages]
        hit = Hit(client.namespace.namespace_id, len(keys) * self.layout.page_tokens, keys, [])
        ahead = self.load_ahead if self.load_ahead is not None else client.suggest_ahead(hit.num_tokens, 1)
        # the configured deadline, else the scheduler side's (from the measured recompute cost)
        deadline_s = self.load_deadline_s if self.load_deadline_s is not None else spec.deadline_s
        load = client.load(hit, into=kv, ahead=ahead, deadline_s=deadline_s, device_ops=self.device_ops)
        return ActiveLoad(spec, kv, load, client)

    def _lease_usable(self, client: KVStoreClient, spec: LoadSpec) -> bool:
        lease = spec.lease
        assert lease is not None
        return (client.arena is not None and lease.num_pages >= spec.first_page + spec.num_pages
                and lease.arena_token in (b"", client.arena.token)  # after a restart: the arena the offsets are in
                and time.monotonic() < lease.expires_at - 1.0)  # a second's margin for the copy itself

    def _copy_leased(self, client: KVStoreClient, spec: LoadSpec, kv: RequestKV) -> tuple[int, bool]:
        """Copies the leased pages into vLLM's blocks; returns how many leading pages are
        valid, and whether the next one failed its checksum. Into a CPU cache, one native call copies every page and checksums it as it
        copies (the blocks of a page that fails, and of all after it, are reported failed and
        recomputed); otherwise each page is checked first and one that fails is not copied."""
        arena = client.arena
        if arena is None or not arena.hold():  # closed by a remap meanwhile: recomputed
            return 0, False
        try:
            return self._copy_held(arena, spec, kv)
        finally:
            arena.drop()

    def _copy_held(self, arena: ArenaMap, spec: LoadSpec, kv: RequestKV) -> tuple[int, bool]:
        lease, first = spec.lease, spec.first_page
        assert lease is not None
        sources = [(arena, offset) for offset in lease.offsets[first : first + spec.num_pages]]
        bad = copy_verified(kv, self.layout, sources, lease.checksums[first : first + spec.num_pages], self.device_ops is not None)
        if bad is None:
            return spec.num_pages, False
        logger.error("leased page %d of request %s failed its checksum", first + bad, spec.req_id)
        return bad, True

    def wait_layer(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        since = time.perf_counter()
        for active in self._loads:
            if active.ok and active.load is not None and not active.load.wait(layer):
                active.ok = False
        self.clock.stalled(since)

    def save_layer(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or layer == len(self.layer_names) - 1:
            return  # the last layer is marked in end_step, once the loads are settled
        for active in self._saves:
            active.kv.release_layer(layer)
            active.save.layer_done(layer)

    def end_step(self) -> None:
        """Settles this step's loads, then lets its saves commit (or cancels them)."""
        failed_reqs, errors = set(), []
        since, started = time.perf_counter(), all(active.client is not None for active in self._loads)
        stretch = 1.0
        for active in self._loads:
            valid, error = self._settle(active)
            if error is not None and active.client is not None:
                errors.append((active.client, error))
            if valid < active.spec.num_pages:
                failed_reqs.add(active.spec.req_id)
                stretch = max(stretch, self._stretch(active))
                self._fail_blocks(active, valid)
            else:
                self.stats.loaded_tokens += active.kv.num_tokens
        self._loads.clear()
        self.clock.stalled(since)
        self.clock.end(loads_ok=started, stretch=stretch)
        self._unsaved.forget(failed_reqs)  # their blocks hold KV computed from blocks that failed to load
        for save in self._saves:
            if save.spec.req_id in failed_reqs:
                save.kv.cancel()  # its KV was computed from blocks that failed to load
                self.stats.saves_cancelled += 1
            else:
                save.kv.release_layer(len(self.layer_names) - 1)
            save.save.mark_all()
            save.marked = True
        self._saves.clear()
        for client, error in errors:  # only now: dropping a client ends its saves early
            self.store.failed(client, error)

    def _stretch(self, active: ActiveLoad) -> float:
        """A load cut short (its deadline) spent its stall on the pages it received: what all
        of them would have cost at that pace, over what it cost (for the cost model)."""
        if active.load is None:
            return 1.0
        return active.spec.num_pages / max(1, min(active.spec.num_pages, active.load.pages_received))

    def _settle(self, active: ActiveLoad) -> tuple[int, BaseException | None]:
        """Pages of the load that are valid in vLLM's blocks, and the load's error; after
        this no byte of it is written any more."""
        load = active.load
        if load is None:
            return active.copied, None
        if active.ok:  # layers vLLM did not wait for (none, normally): wait now, bounded
            active.ok = all(load.wait(layer) for layer in range(len(self.layer_names)))
        if not active.ok:  # abandoned: num_tokens is 0; a page failed its check: the pages before it
            load.abandon("not complete when the step ended")
        return load.num_tokens // self.layout.page_tokens, load.error

    def _fail_blocks(self, active: ActiveLoad, valid_pages: int) -> None:
        first_token = (active.spec.first_page + valid_pages) * self.layout.page_tokens
        end_token = (active.spec.first_page + active.spec.num_pages) * self.layout.page_tokens
        blocks = active.spec.block_ids[first_token // self.block_size : -(-end_token // self.block_size)]
        self._failed_blocks.update(blocks)
        self.stats.failed_loads += 1
        self.stats.failed_blocks += len(blocks)
        logger.warning("kvstore load of request %s: %d of %d pages valid; vLLM recomputes %d blocks",
                       active.spec.req_id, valid_pages, active.spec.num_pages, len(blocks))

    def load_errors(self) -> set[int]:
        errors, self._failed_blocks = self._failed_blocks, set()
        return errors

    # -- after the step ------------------------------------------------------------------

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished whose saves are all done: their blocks may be freed.
        (vLLM holds the blocks of every request that had a save scheduled, so each of
        those is reported exactly once, also when its save could not start.) A finished
        request whose saves left pages unsaved saves them again first, once."""
        self._finishing |= finished_req_ids & self._saving
        for req_id in list(self._pending):
            still = [s for s in self._pending[req_id] if not self._ended(s)]
            if still:
                self._pending[req_id] = still
            else:
                del self._pending[req_id]
        for req_id in self._finishing - self._pending.keys():
            self._save_again(req_id)
        reported = {r for r in self._finishing if r not in self._pending and not self._unsaved.waiting(r)}
        self._finishing -= reported
        self._saving -= reported
        self._unsaved.finished(reported)
        return reported

    def _save_again(self, req_id: str) -> None:
        """A finished request whose saves left pages unsaved: saves them now, once, while
        vLLM holds its blocks (it has no next step to do it in)."""
        client = self.store.client()
        spec = self._unsaved.to_save(req_id, client is not None)
        if spec is not None:
            logger.info("kvstore: finished request %s has %d pages stored, not %d; saving the rest again", req_id,
                        spec.first_page, len(spec.tokens) // self.layout.page_tokens)
            self.stats.saves_again += 1
            self._start_save(client, spec, computed=True)

    def _ended(self, active: ActiveSave) -> bool:
        """True (and counted) once the save committed, failed or was cancelled."""
        if not active.marked or not active.save.wait(0):
            return False
        spec, p = active.spec, self.layout.page_tokens
        stored = spec.first_page * p
        try:
            stored = active.save.result()
            self.stats.saved_tokens += stored - spec.first_page * p
        except SessionFenced:  # its session moved (sessions.py): reported, never saved here again
            self.stats.saves_fenced += 1
            return self._unsaved.fenced(spec.req_id)
        except StaleGeneration:  # invalidated since its lookup (DESIGN §3): sent again, it would be refused again
            self.stats.saves_stale += 1
            self._unsaved.stale(spec.req_id)
            self._stale.add(spec.req_id)  # reported: its later pages name the same generation, none is sent
            return True
        except KVStoreError as exc:
            if not active.kv.cancelled:
                self.stats.saves_failed += 1
                logger.warning("kvstore save of request %s failed: %s", spec.req_id, exc)
        if stored < len(spec.tokens):
            if active.kv.cancelled:  # computed from KV that failed to load: never to be saved
                self._short[spec.req_id] = min(self._short.get(spec.req_id, stored // p), stored // p)
            else:
                self._stored_short(spec, stored // p)
        else:
            self._unsaved.ended_whole(spec)
        return True

    def _stored_short(self, spec: SaveSpec, pages: int) -> None:
        """``spec``'s request has at most ``pages`` leading pages stored: the scheduler side
        is told (its next step saves again), and a finished request saves again here."""
        self._short[spec.req_id] = min(self._short.get(spec.req_id, pages), pages)
        self._unsaved.ended_short(spec, pages)

    def report(self) -> KVStoreWorkerMetadata | None:
        """Requests whose saves ended short since the last report, and the steps and loads
        timed since, for the scheduler side."""
        (steps, loads), fenced = self.clock.take(), self._unsaved.take_fenced()
        if not (self._short or steps or loads or fenced or self._stale):
            return None
        report = KVStoreWorkerMetadata(self._short, steps, loads, fenced, self._stale)
        self._short, self._stale = {}, set()
        return report

    def wait_saves(self, timeout_s: float) -> bool:
        """Waits for every save marked done so far to commit or fail (benchmarks use it to
        keep one request's save from overlapping the next one's timing); False on timeout."""
        deadline = time.monotonic() + timeout_s
        running = [s.save for saves in self._pending.values() for s in saves if s.marked]
        return all(save.wait(max(0.0, deadline - time.monotonic())) for save in running)

    def preempted(self, req_ids: set[str]) -> None:
        """vLLM is about to reuse these requests' blocks: their saves must stop reading
        them first (a save still running is cancelled and waited for)."""
        self._unsaved.forget(req_ids)
        for req_id in req_ids & set(self._pending):
            for active in self._pending[req_id]:
                if active.marked and not active.save.wait(0):
                    active.kv.cancel()
                    active.save.join(self.store.connect_timeout_s)

    def shutdown(self) -> None:
        for save in self._saves:
            save.kv.cancel()
            save.save.abandon("engine shutting down")
        for load in self._loads:
            if load.load is not None:
                load.load.abandon("engine shutting down")
