"""The connector's use of the cost model (kvstore/cost_model.py): what its workers measure,
and the scheduler side's decision of how much of a hit to load.

More: client/adapters/vllm/README.md (### costs.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvstore import cost_model

logger = logging.getLogger(__name__)

Observation = tuple[int, float]  # (units, seconds)
MIN_DEADLINE_S = 0.05
DEFAULT_PREFILL_TOKENS_PER_S = 3000.0  # KVStoreClient's default prefill speed, until a client is connected


def prefill_tokens(out: Any) -> int:
    """Tokens vLLM's step (its ``SchedulerOutput``) computes for requests still in their
    context: a new request's, the next chunk of a prompt (a request with no output yet) and
    a preempted request's recompute (resumed). A request with output tokens decodes: its
    tokens (the next one, any speculative ones) are not counted. Without output counts (an
    older vLLM) every scheduled token is."""
    scheduled, cached = out.num_scheduled_tokens, out.scheduled_cached_reqs
    outputs = getattr(cached, "num_output_tokens", None) or [0] * len(cached.req_ids)
    resumed = cached.resumed_req_ids or set()
    return (sum(scheduled.get(new.req_id, 0) for new in out.scheduled_new_reqs)
            + sum(scheduled.get(req_id, 0) for req_id, n in zip(cached.req_ids, outputs) if n == 0 or req_id in resumed))


class StepClock:
    """Times one worker's steps: ``begin``, any number of ``stalled``, ``end``.
    Observations accumulate until ``take``. Called from vLLM's worker thread only."""

    def __init__(self) -> None:
        self._start = 0.0
        self._tokens = 0
        self._load_bytes = 0
        self._stall_s = 0.0
        self._steps: list[Observation] = []
        self._loads: list[Observation] = []

    def begin(self, num_tokens: int, load_bytes: int) -> None:
        """``num_tokens``: the step's prefill tokens (``prefill_tokens``); a step with none
        and no load is not observed."""
        self._start = time.perf_counter()
        self._tokens, self._load_bytes, self._stall_s = num_tokens, load_bytes, 0.0

    def stalled(self, since: float) -> None:
        """The step waited for its loads from ``since`` (``time.perf_counter()``) until now."""
        self._stall_s += time.perf_counter() - since

    def end(self, loads_ok: bool = True, stretch: float = 1.0) -> None:
        """Ends the step. ``loads_ok`` False: a load could not even start (no store), so
        its stall says nothing of what a load costs. ``stretch``: a load was cut short
        (its deadline) after a part of its pages; the whole would have stalled the step this
        many times longer (without it, a load cut at twice the recompute time would count
        as costing just that, and a recompute measured twice as slow later would load again)."""
        if self._load_bytes:
            if loads_ok:
                self._loads.append((self._load_bytes, self._stall_s * stretch))
        elif self._tokens > 0:
            self._steps.append((self._tokens, time.perf_counter() - self._start))
        self._tokens = self._load_bytes = 0

    def take(self) -> tuple[list[Observation], list[Observation]]:
        """(recompute observations, fetch observations) since the last call."""
        steps, loads = self._steps, self._loads
        self._steps, self._loads = [], []
        return steps, loads


@dataclass
class LoadStats:
    """The scheduler side's counters (never reset): of the tokens kvstore holds beyond
    vLLM's own hit (``found_tokens``), how many were handed to vLLM to load and how many
    were left to recompute because loading them was measured to be slower. ``probes``: hits
    handed to vLLM to load though measured slower, to measure them again (a size skipped
    ``cost_model.PROBE_EVERY`` times in a row); their tokens count in ``loaded_tokens``."""

    found_tokens: int = 0
    loaded_tokens: int = 0
    skipped_tokens: int = 0
    requests_skipped: int = 0
    probes: int = 0


@dataclass
class LoadPolicy:
    """Decides how much of a hit to load, from the costs the workers measured.
    ``enabled`` False: every hit is loaded (and still measured). The priors are a gRPC
    client's until the first decision, which takes those of the connected client's
    transport (they matter only while nothing is measured)."""

    bytes_per_token: int
    enabled: bool = True
    stats: LoadStats = field(default_factory=LoadStats)

    def __post_init__(self) -> None:
        self.costs = cost_model.LoadCosts(self.bytes_per_token, cost_model.fetch_prior(False),
                                          cost_model.recompute_prior(DEFAULT_PREFILL_TOKENS_PER_S))
        self._priors_set = False

    def decide(self, client: Any, request_id: str, found_tokens: int) -> int:
        """How many of ``found_tokens`` (beyond vLLM's own hit, aligned to blocks) to load."""
        self.stats.found_tokens += found_tokens
        if not self.enabled or found_tokens <= 0 or client is None:
            return found_tokens
        if not self._priors_set:
            self.costs.fetch.prior = cost_model.fetch_prior(bool(client.shared_memory))
            self.costs.recompute.prior = cost_model.recompute_prior(client.prefill_tokens_per_s)
            self._priors_set = True
        probes = self.costs.num_probes
        load = self.costs.worth_loading(found_tokens)
        self.stats.probes += self.costs.num_probes - probes
        if load < found_tokens:
            self.stats.skipped_tokens += found_tokens - load
            self.stats.requests_skipped += 1
            logger.debug("kvstore: request %s recomputes %d found tokens (fetch %.1f ms > recompute %.1f ms)", request_id,
                         found_tokens - load, 1e3 * self.costs.fetch_s(found_tokens), 1e3 * self.costs.recompute_s(found_tokens))
        return load

    def deadline_s(self, num_tokens: int) -> float:
        """The most a load of ``num_tokens`` may hold up its step: twice the measured cost of
        recomputing them (at least 50 ms; with the prior, the client's own default). A load
        past it is abandoned and recomputed, and the wait is measured: the next such hit is
        then recomputed at once."""
        return max(MIN_DEADLINE_S, 2.0 * self.costs.recompute_s(num_tokens))

    def loaded(self, num_tokens: int) -> None:
        self.stats.loaded_tokens += num_tokens

    def measured(self, steps: list[Observation], loads: list[Observation]) -> None:
        """Feeds the workers' observations (their metadata of one step) to the model."""
        for tokens, seconds in steps:
            self.costs.recompute.observe(tokens, seconds)
        for num_bytes, seconds in loads:
            self.costs.fetch.observe(num_bytes, seconds)
