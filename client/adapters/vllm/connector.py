"""``KVStoreConnector``: vLLM's KV connector (V1) backed by kvstore.

More: client/adapters/vllm/README.md (### connector.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats, PromMetric, PromMetricT

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.connector_settings import ConnectorConfig, engine_namespace
from kvstore.client.adapters.vllm.connector_stats import CounterDeltas, KVStoreConnectorStats, KVStorePromMetrics
from kvstore.client.adapters.vllm.groups import KVGroups
from kvstore.client.adapters.vllm.hybrid_scheduler import HybridSchedulerSide
from kvstore.client.adapters.vllm.hybrid_states import state_namespace
from kvstore.client.adapters.vllm.hybrid_worker import HybridWorkerSide
from kvstore.client.adapters.vllm.metadata import KVStoreConnectorMetadata, KVStoreWorkerMetadata
from kvstore.client.adapters.vllm.pd import HandoffScheduler
from kvstore.client.adapters.vllm.pd_worker import HandoffWorker
from kvstore.client.adapters.vllm.scheduler import SchedulerSide
from kvstore.client.adapters.vllm.sessions import SESSION_KEY, SessionLogs
from kvstore.client.adapters.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)



def _tp_rank_size(role: KVConnectorRole) -> tuple[int, int | None]:
    """The worker's tensor-parallel shard; the scheduler looks up shard 0's pages."""
    if role != KVConnectorRole.WORKER:
        return 0, None
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. With several KV cache groups (vLLM's hybrid KV cache
    manager: sliding-window, chunked-local, full attention and state-space layers) the
    hybrid sides serve it (hybrid_scheduler.py, hybrid_worker.py; states at page
    boundaries go through ``states``, a connection to their own namespace); one
    full-attention group keeps the single-group sides."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config  # the base class refused a config without one
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        if transfer.kv_load_failure_policy != "recompute":
            logger.warning('kv_load_failure_policy is "%s": a kvstore page that cannot be loaded fails its request; '
                           'set "kv_load_failure_policy": "recompute" to recompute it instead', transfer.kv_load_failure_policy)
        tp_rank, tp_size = _tp_rank_size(role)
        namespace = engine_namespace(vllm_config, kv_cache_config, self.config, tp_rank, tp_size)
        groups = KVGroups.of(kv_cache_config)
        layer_names, spec = groups.layer_names, groups.spec
        self.store = StoreConnection(self.config.address, namespace, use_shm=self.config.use_shm, retry_s=self.config.retry_s,
                                     use_call_socket=self.config.use_call_socket, credentials=self.config.credentials)
        self.store.start()
        states = state_namespace(self.store.namespace, groups)  # state-space groups: states at page boundaries
        self.states = None if states is None else StoreConnection(
            self.config.address, states, use_shm=self.config.use_shm, retry_s=self.config.retry_s,
            use_call_socket=self.config.use_call_socket, credentials=self.config.credentials)
        if self.states is not None:
            self.states.start()
        self.hybrid = groups.hybrid
        self._warned_sessions = False
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | HybridWorkerSide | None = None
        self.handoffs: HandoffScheduler | None = None  # disaggregated prefill (pd.py)
        self.handoff_worker: HandoffWorker | None = None
        self.sessions: SessionLogs | None = None  # requests' token logs, for live migration (sessions.py); single-group
        if role == KVConnectorRole.SCHEDULER and self.hybrid:
            self.scheduler = HybridSchedulerSide(self.store, groups, self.config.lookup_timeout_s, self._block_tables,
                                                 self.config.load_when_faster, self.states)
            self.handoffs = HandoffScheduler(self.scheduler, self.config.handoff_deadline_s, self.config.handoff_ttl_s)
        elif self.hybrid:
            self.worker = HybridWorkerSide(self.store, layer_names, groups.layer_groups, spec.block_size,
                                           self.config.load_deadline_s, self.states, groups.state_layer_names,
                                           [g.index for g in groups.state_groups for _ in g.layer_names])
            # its saves copy whole pages out when the step ends: no layer goes ahead of them
            self.handoff_worker = HandoffWorker(self.store, spec.block_size, self.config.lookup_timeout_s,
                                                self.config.handoff_deadline_s, push_layers=False)
        elif role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.store, spec.block_size, self.config.lookup_timeout_s, self.config.load_when_faster)
            self.handoffs = HandoffScheduler(self.scheduler, self.config.handoff_deadline_s, self.config.handoff_ttl_s)
            self.sessions = SessionLogs(self.store, self.scheduler, self.config.lookup_timeout_s)
        else:
            self.worker = WorkerSide(self.store, layer_names, spec.block_size, kv_cache_config.num_blocks,
                                     self.config.load_deadline_s, self.config.load_ahead, self.config.sync_load_pages)
            self.handoff_worker = HandoffWorker(self.store, spec.block_size, self.config.lookup_timeout_s,
                                                self.config.handoff_deadline_s, push_layers=self.config.push_layers())
        self._counts = CounterDeltas(self.scheduler.policy.stats if self.scheduler is not None else self._worker().stats)
        logger.info("kvstore connector (%s) for %s at %s, %d-token pages", role.name, namespace.model, self.config.address,
                    namespace.layout.page_tokens)  # the namespace id (salted for a tenant) is logged at connect

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # layer-wise waits and saves must run between graph pieces

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save lost to preemption is a later miss

    # -- metrics (connector_stats.py): vLLM asks both sides after every step -------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._counts.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=data or {})  # its own copy of the dict

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side ---------------------------------------------------------------------

    def _worker(self) -> WorkerSide | HybridWorkerSide:
        assert self.worker is not None, "a worker hook was called on the scheduler's connector"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register(kv_caches)
        if self.handoff_worker is not None and not self.hybrid:  # a hybrid worker receives a handoff itself
            self.handoff_worker.register([kv_caches[name] for name in self._worker().layer_names])

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVStoreConnectorMetadata)
        if self.handoff_worker is not None:
            self.handoff_worker.begin_step(connector_metadata)  # handoffs open before the saves start
        self._worker().begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        self._worker().start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        self._worker().save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker().end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        worker = self._worker()
        saved = worker.finished(finished_req_ids)
        if self.handoff_worker is None:
            return saved or None, None
        ended = self.handoff_worker.saving() - worker.saving() if isinstance(worker, HybridWorkerSide) else None
        sending, recving = self.handoff_worker.finished(saved, finished_req_ids, ended)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """A hybrid engine's loads end in the step that starts them: landed, or failed
        (vLLM then recomputes the request from its start; see hybrid_worker.py)."""
        results = super().get_transfer_results(finished_req_ids)
        worker = self._worker()
        if isinstance(worker, HybridWorkerSide):
            results.finished_recving, results.failed_recving = worker.transfer_results(finished_req_ids)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._worker().load_errors()
        return errors | self.handoff_worker.load_errors() if self.handoff_worker is not None else errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self._worker().report()
        short = self.handoff_worker.take_short() if self.handoff_worker is not None else {}
        if short:  # a decode's receive came short: its saves start where its pages end
            report = report if isinstance(report, KVStoreWorkerMetadata) else KVStoreWorkerMetadata()
            report.stored_pages.update(short)
        return report

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVStoreConnectorMetadata) and kv_connector_metadata.preempted:
            self._worker().preempted(kv_connector_metadata.preempted)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.handoff_worker is not None:
            self.handoff_worker.shutdown()
        self.store.close()
        if self.states is not None:
            self.states.close()

    # -- scheduler side ------------------------------------------------------------------

    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler is not None, "a scheduler hook was called on a worker's connector"
        return self.scheduler

    def _block_tables(self, req_id: str) -> tuple[list[int], ...]:
        """A request's current block ids in every group, from vLLM's cache manager."""
        assert self._kv_cache_manager is not None, "vLLM did not bind its KV cache manager"
        return self._kv_cache_manager.get_block_ids(req_id)

    def on_new_request(self, request: Request) -> None:
        if self.sessions is not None:
            self.sessions.begin(request)
        elif self.hybrid and not self._warned_sessions and (request.kv_transfer_params or {}).get(SESSION_KEY):
            self._warned_sessions = True
            logger.warning("kvstore: this engine has several KV cache groups; sessions (live migration) are not built "
                           "for them yet: requests with %s are served as any request", SESSION_KEY)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        handed = self.handoffs.matched(request, num_computed_tokens) if self.handoffs is not None else None
        if handed is not None:
            return handed  # a decode's handoff: loaded asynchronously (pd.py)
        found = self._scheduler().num_new_matched_tokens(request, num_computed_tokens)
        if self.sessions is not None:
            self.sessions.attach(request.request_id)  # its saves name its session
        return found, self.hybrid and found > 0  # a hybrid engine's hit is loaded before the request computes

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        scheduler = self._scheduler()
        if self.handoffs is not None and self.handoffs.after_alloc(request, blocks, num_external_tokens):
            if self.sessions is not None:
                self.sessions.attach(request.request_id)  # a decode's saves name its session too (tracked from here)
        elif isinstance(scheduler, HybridSchedulerSide):
            scheduler.after_alloc(request, num_external_tokens, blocks)
        else:
            scheduler.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._scheduler().build_meta(scheduler_output)
        if self.sessions is not None:  # after: a fence it learns of stops saves from the next step on
            self.sessions.step(scheduler_output)
        return self.handoffs.add_to(meta) if self.handoffs is not None else meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls this instead of ``request_finished`` for a connector that supports
        its hybrid KV cache manager, whatever the number of groups."""
        return self._finished(request)

    def _finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self.sessions is not None:
            self.sessions.finished(request)
        scheduler = self._scheduler()
        limit = scheduler.handoff_limit(request.request_id) if isinstance(scheduler, HybridSchedulerSide) else None
        saving = scheduler.finished(request)
        return self.handoffs.finished(request, saving, limit) if self.handoffs is not None else (saving, None)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().saves_finished(set(connector_output.finished_sending or ()))
        if self.handoffs is not None:
            self.handoffs.sent(set(connector_output.finished_sending or ()))
        report = connector_output.kv_connector_worker_meta
        self._scheduler().saves_short(report if isinstance(report, KVStoreWorkerMetadata) else None)
        self._scheduler().measured(report if isinstance(report, KVStoreWorkerMetadata) else None)
        if self.sessions is not None and isinstance(report, KVStoreWorkerMetadata) and report.fenced:
            self.sessions.saves_refused(report.fenced)
        scheduler = self._scheduler()
        if isinstance(scheduler, HybridSchedulerSide) and connector_output.failed_recving:
            scheduler.loads_failed(set(connector_output.failed_recving))

    def has_pending_block_frees(self) -> bool:
        return self._scheduler().holds_blocks or (self.handoffs is not None and self.handoffs.holds_blocks)
