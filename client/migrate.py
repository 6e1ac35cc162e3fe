"""Live migration of a running session (DESIGN §12.8), mixed into KVStoreClient.

The client is connected to the session's source node (where its token log is)::

    summary = await client.migrate("req-42", "node-b")       # returns once node-b owns the session
    # summary.rounds, summary.round_bytes, summary.pause_ms, summary.total_bytes, summary.version

More: client/README.md (### migrate.py).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore._proto import migration_pb2, migration_pb2_grpc
from kvstore.client.runtime import Runtime
from kvstore.errors import CannotConverge, InvalidRequest, TierUnavailable
from kvstore.page import LayoutDesc

if TYPE_CHECKING:
    from kvstore.client.hit import Hit
    from kvstore.types import KVLayout, Namespace

DEFAULT_PAUSE_BYTES = 64 << 20  # the last delta copied after the fence: ~3 ms at 25 GB/s
DEFAULT_MAX_ROUNDS = 32
DEFAULT_STALL_ROUNDS = 3
FRUITLESS_WAITS_S = (0.5, 1.0, 2.0)  # after a round that copied nothing: a link back from a cut reconnects (<= 1 s backoff)


class PauseBudget:
    """The bytes a fence may leave for its pause: ``max_pause_ms`` at the best copy rate a round
    showed. Why the best and not the last: the last rounds copy a page or two, mostly fixed cost
    (35-45 ms a round), so their rate put the budget under one page while growth kept one or two
    pages left, and a session that converges was given up as CannotConverge (kvstore-bench migrate)."""

    def __init__(self, max_pause_bytes: int, max_pause_ms: float | None) -> None:
        self.bytes = max_pause_bytes
        self._ms = max_pause_ms
        self._best_rate = 0.0

    def observe(self, copied_bytes: int, seconds: float) -> None:
        if self._ms is None or copied_bytes <= 0:
            return
        self._best_rate = max(self._best_rate, copied_bytes / max(1e-6, seconds))
        self.bytes = int(self._best_rate * self._ms / 1000)


@dataclass
class MigrationSummary:
    session_id: str
    source: str
    target: str
    version: int = 0                # the session's version the target owns
    rounds: int = 0                 # pre-copy rounds, the delta after the fence not counted
    round_bytes: list[int] = field(default_factory=list)  # page bytes each round copied, then the delta's
    pause_ms: float = 0.0           # fence asked -> target adopted (the session takes no writes meanwhile)
    total_bytes: int = 0
    total_s: float = 0.0
    num_tokens: int = 0             # the session's log length at the target
    forced: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class MigrateCalls:
    """Mixed into KVStoreClient, whose ``namespace``, ``layout``, ``runtime``, ``node``, ``keys``,
    ``lookup``, ``read_session`` and ``_io`` these use."""

    namespace: Namespace
    layout: KVLayout
    runtime: Runtime
    node: str
    timeout_s: float
    _token: str | None
    _tls: Any
    _io: Callable[..., Any]
    keys: Callable[[Any], list[bytes]]
    lookup: Callable[..., Any]

    async def migrate(self, session_id: str, target: str, *, max_pause_bytes: int = DEFAULT_PAUSE_BYTES,
                      max_pause_ms: float | None = None, max_rounds: int = DEFAULT_MAX_ROUNDS, stall_rounds: int = DEFAULT_STALL_ROUNDS,
                      abort: bool = False, target_address: str | None = None,
                      on_round: Callable[[int, int, int], Any] | None = None) -> MigrationSummary:
        """Moves session ``session_id`` from this client's node to node ``target``; see the module
        docstring. ``max_pause_ms``: instead of bytes, fence once the rest would copy within it
        at the best copy rate a round showed (PauseBudget). ``on_round(round, bytes copied, bytes left)`` is called after each round (a
        benchmark's catch-up curve; it may be a coroutine function). Raises CannotConverge (nothing fenced), SessionFenced (the
        session is another node's, or an abort won), or KVStoreError when a node is unreachable
        (call again to resume, or ``abort=True``)."""
        if max_pause_bytes < 0 or max_rounds < 1 or stall_rounds < 1 or (max_pause_ms is not None and max_pause_ms < 0):
            raise InvalidRequest("max_pause_bytes and max_pause_ms must be >= 0, max_rounds and stall_rounds >= 1")
        if not target or target == self.node:
            raise InvalidRequest(f"target must be another node than this client's ({self.node!r}), got {target!r}")
        ns = self.namespace.namespace_id
        here = await self._move(self.runtime, "Status", migration_pb2.SessionStatusRequest(
            namespace_id=ns, session_id=session_id, to_node=target))
        version, address = int(here.version), target_address or here.to_address
        if not address:
            raise InvalidRequest(f"node {target!r} is not a member this node knows (give target_address)")
        there = Runtime(address, self.timeout_s, token=self._token, tls=self._tls)
        try:
            await there.call(there.open())
            if abort:
                await self._move(self.runtime, "Abort", migration_pb2.AbortSessionRequest(namespace_id=ns, session_id=session_id))
                await self._move(there, "Abort", migration_pb2.AbortSessionRequest(namespace_id=ns, session_id=session_id))
                return MigrationSummary(session_id, self.node, target)
            try:
                return await self._migrate(there, session_id, target, version, (max_pause_bytes, max_pause_ms), max_rounds,
                                           stall_rounds, on_round)
            except CannotConverge:  # nothing fenced: the target's copy of the log goes (its pages stay, as any copies)
                await self._move(there, "Abort", migration_pb2.AbortSessionRequest(namespace_id=ns, session_id=session_id))
                raise
        finally:
            await asyncio.get_running_loop().run_in_executor(None, there.close)

    async def take_over(self, session_id: str, source: str) -> MigrationSummary:
        """With a client of the target node: the session's source ``source`` is gone for good
        (not a member: its lease expired) mid-migration, and this node takes the session over with
        what the migration's rounds copied here (its log copy and pages; tokens the source logged
        after the last round are lost with it). SessionFenced while ``source`` is a member, or when
        another node was decided owner; InvalidRequest when nothing of the session was copied here."""
        started = time.monotonic()
        adopted = await self._move(self.runtime, "Adopt", migration_pb2.AdoptSessionRequest(
            namespace_id=self.namespace.namespace_id, session_id=session_id, force=True, source=source))
        return MigrationSummary(session_id, source, self.node, version=int(adopted.version), total_s=time.monotonic() - started,
                                num_tokens=int(adopted.num_tokens), forced=True)

    async def _move(self, runtime: Runtime, method: str, request: Any) -> Any:
        async def call() -> Any:
            stub = migration_pb2_grpc.MigrationStub(runtime._channel)
            return await runtime.rpc(getattr(stub, method), request)
        return await runtime.call(call())

    async def _migrate(self, there: Runtime, session_id: str, target: str, version: int, pause: tuple[int, float | None],
                       max_rounds: int, stall_rounds: int,
                       on_round: Callable[[int, int, int], Any] | None) -> MigrationSummary:
        ns = self.namespace.namespace_id
        page_bytes = LayoutDesc.of(self.layout).page_bytes
        summary = MigrationSummary(session_id, self.node, target)
        started = time.monotonic()
        copied, left_before, stalled, fruitless = 0, None, 0, 0
        budget = PauseBudget(*pause)
        while True:
            logged = await self.read_session(session_id)  # type: ignore[attr-defined]
            if logged is None:
                raise InvalidRequest(f"no session {session_id!r} at node {self.node}")
            if summary.rounds >= max_rounds:
                raise CannotConverge(f"session {session_id!r}: {max_rounds} rounds without the rest falling under "
                                     f"{budget.bytes} bytes; nothing fenced, node {self.node} keeps it")
            stored = await self._stored(logged.tokens)
            left = (len(stored) - copied) * page_bytes
            if summary.rounds and left <= budget.bytes:
                break
            if fruitless:
                pass  # trying the same round again after it copied nothing: not a round that lost to growth
            elif left_before is not None and left >= left_before:
                stalled += 1
                if stalled >= stall_rounds:
                    raise CannotConverge(f"session {session_id!r} grows at least as fast as it is copied to {target} "
                                         f"({left} bytes left after {summary.rounds} rounds, not shrinking); nothing "
                                         f"fenced, node {self.node} keeps it")
            else:
                stalled = 0
            left_before = left
            round_started = time.monotonic()
            held = await self._copy(there, session_id, stored, logged, version)
            budget.observe((held - copied) * page_bytes, time.monotonic() - round_started)
            if held <= copied < len(stored):  # no progress: not a race with growth, a fetch that fails
                if fruitless == len(FRUITLESS_WAITS_S):
                    raise TierUnavailable(f"node {target} copied none of the {len(stored) - copied} pages left of session "
                                          f"{session_id!r} in {fruitless + 1} tries (no room for the tenant there, or node "
                                          f"{self.node} did not send them); nothing fenced: call again to resume")
                await asyncio.sleep(FRUITLESS_WAITS_S[fruitless])  # e.g. the target's channel to here still reconnecting
                fruitless += 1
                continue
            fruitless = 0
            summary.rounds += 1
            summary.round_bytes.append(max(0, held - copied) * page_bytes)
            copied = max(copied, held)
            if on_round is not None and inspect.isawaitable(done := on_round(summary.rounds, summary.round_bytes[-1],
                                                                             left - summary.round_bytes[-1])):
                await done
        fence_at = time.monotonic()
        fenced = await self._move(self.runtime, "Fence", migration_pb2.FenceSessionRequest(
            namespace_id=ns, session_id=session_id, to_node=target))
        final = type(logged)(int(fenced.prompt_tokens), list(fenced.tokens))
        stored = await self._stored(final.tokens)
        held = await self._copy(there, session_id, stored, final, version)
        summary.round_bytes.append(max(0, held - copied) * page_bytes)
        adopted = await self._move(there, "Adopt", migration_pb2.AdoptSessionRequest(
            namespace_id=ns, session_id=session_id, version=int(fenced.version), prompt_tokens=final.prompt_tokens,
            tokens=final.tokens))
        summary.pause_ms = (time.monotonic() - fence_at) * 1000
        summary.version, summary.num_tokens = int(adopted.version), int(adopted.num_tokens)
        summary.total_bytes = sum(summary.round_bytes)
        summary.total_s = time.monotonic() - started
        return summary

    async def _stored(self, tokens: list[int]) -> list[bytes]:
        """The keys of the leading pages of ``tokens`` stored in the cluster (the source's saves)."""
        hit: Hit = await self.lookup(tokens)
        return list(hit.keys)

    async def _copy(self, there: Runtime, session_id: str, keys: list[bytes], logged: Any, version: int) -> int:
        request = migration_pb2.CopySessionRequest(
            namespace_id=self.namespace.namespace_id, session_id=session_id, source=self.node, keys=keys,
            page_bytes=LayoutDesc.of(self.layout).page_bytes, prompt_tokens=logged.prompt_tokens, tokens=logged.tokens,
            version=version)
        return int((await self._move(there, "Copy", request)).num_pages)
