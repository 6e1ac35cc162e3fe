"""The disaggregated-prefill worker's records (pd_worker.py): its counters, and one record per
handoff open, completion and receive in flight, each with the runtime's Job that runs it; and
the decode side's let-go of a handoff at its node (``let_go``).

More: client/adapters/vllm/README.md (### pd_worker.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.client.adapters.vllm.metadata import HandoffComplete, HandoffLoad, HandoffOpen
from kvstore.client.adapters.vllm.pd_leases import Taken
from kvstore.client.client import KVStoreClient
from kvstore.errors import KVStoreError


@dataclass
class HandoffStats:
    """Counters tests and logs read (never reset)."""

    opened: int = 0
    open_failed: int = 0
    completed: int = 0
    completed_tokens: int = 0  # handed off, as handoff_complete answered
    complete_failed: int = 0
    received: int = 0  # receives whose every page arrived
    received_tokens: int = 0
    receive_failed: int = 0  # receives with pages missing: vLLM recomputed them
    received_leased: int = 0  # receives copied from the arena (leased), not through a staging tensor
    failed_blocks: int = 0


@dataclass
class Opening:
    spec: HandoffOpen
    job: Any  # the runtime's Job of handoff_open
    give_up_at: float
    client: KVStoreClient
    # cancelled by its completion past open_timeout_s: the runtime's "cancelled" is no transport failure
    given_up: bool = False


@dataclass
class Completing:
    spec: HandoffComplete
    job: Any = None  # the runtime's Job of handoff_complete, once started
    give_up_at: float = 0.0
    client: KVStoreClient | None = None
    given_up: bool = False  # cancelled past its deadline or at shutdown: counted failed, the connection kept


@dataclass
class Receiving:
    spec: HandoffLoad
    job: Any  # the runtime's Job of the receive (None: not started, the store is not connected yet)
    start_by: float  # the request's deadline: a receive not started by then is given up on
    give_up_at: float
    client: KVStoreClient | None
    taken: Taken | None = None  # the leased pages, set by the job before it ends (given back once copied)
    staging: torch.Tensor | None = None  # a store on another host: the pages got into this


class FailedJob:
    """A completion that could not start (no store, or its client closed under the step): ended, failed."""

    def __init__(self, exc: KVStoreError | None = None) -> None:
        self.result: concurrent.futures.Future[int] = concurrent.futures.Future()
        self.result.set_exception(exc or KVStoreError("the store could not be reached"))

    def cancel(self) -> None:
        """Nothing runs."""


async def ended(job: concurrent.futures.Future[Any], timeout_s: float) -> None:
    """Waits (on the runtime's loop) at most ``timeout_s`` for another job's ``result`` to end.
    Its outcome is read once it comes: asyncio logs an exception never read as an error."""
    waited = asyncio.wrap_future(job)
    waited.add_done_callback(lambda f: f.cancelled() or f.exception())
    await asyncio.wait({waited}, timeout=max(0.001, timeout_s))


def let_go(client: KVStoreClient, handoff_id: str) -> None:
    """A decode takes nothing more of the handoff (its load ended, or it needs none): a Complete
    with no page at its own node, in the background, so that the node drops the marker with its
    pins now, not at the ttl, and for the ttl a push still on its way pins nothing (DESIGN §12.7).
    Sent once nothing of it is read any more: pages leased for a copy keep that lease of their own."""
    client.runtime.detach(client.handoff_complete(handoff_id, [], client.node))
