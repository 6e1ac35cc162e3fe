"""KVStoreClient: store the KV an engine computed, find the longest stored prefix, fetch it.

More: client/README.md (### client.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Self, TypeVar, cast

import torch

from kvstore._proto import data_pb2, directory_pb2
from kvstore.client.arena import ArenaMap
from kvstore.client.calls import Calls
from kvstore.client.engine_kv import EngineKV, as_engine_kv
from kvstore.client.handoff import HandoffCalls
from kvstore.client.hit import Hit
from kvstore.client.layerwise import DeviceOps, LayerLoad, LayerSave
from kvstore.client.migrate import MigrateCalls
from kvstore.client.namespace_calls import NamespaceCalls
from kvstore.client.restart import ServerAgain, map_arena
from kvstore.client.runtime import Runtime
from kvstore.client.session import LoggedSession, Recovery, SessionLog
from kvstore.client.session import recover as recover_session
from kvstore.client.tenant import tenant_namespace
from kvstore.client.transport import NamespaceServer, ShmTransport, StreamTransport, Transport
from kvstore.client.transport.contract import check_engine_kv
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.keys import page_keys, token_array
from kvstore.page import FLAG_SESSION_OPEN, FLAG_WANTED, LayoutDesc
from kvstore.page_wire.grpc_chunks import CHUNK_BYTES, check_chunk_bytes
from kvstore.security.channel import ClientTLS
from kvstore.types import PAGE_KEY_BYTES, LocationRun, Namespace
from kvstore.validate import deadline_s, layout_msg

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["Hit", "KVStoreClient"]

MAX_ETA_MS = 2**32 - 1  # HintEntry.eta_ms is a uint32 (the server refuses more than --max-hint-eta-s)


def _eta_ms(eta_s: float) -> int:
    """``eta_s`` as the wire's milliseconds (a past eta is now); one the wire cannot hold is
    InvalidRequest, not protobuf's ValueError."""
    if not math.isfinite(eta_s) or eta_s * 1000 > MAX_ETA_MS:
        raise InvalidRequest(f"hint eta_s must be a finite number of seconds below {MAX_ETA_MS // 1000}, got {eta_s}")
    return max(0, int(eta_s * 1000))


class KVStoreClient(NamespaceCalls, HandoffCalls, MigrateCalls):
    """One namespace's view of a kvstore server. Use as ``async with``."""

    def __init__(
        self,
        address: str,
        namespace: Namespace,
        *,
        use_shm: bool = True,
        timeout_s: float = 30.0,
        lease_ms: int = 30_000,
        copy_threads: int = 2,
        prefill_tokens_per_s: float = 3000.0,
        chunk_bytes: int = CHUNK_BYTES,
        token: str | None = None,
        tls: ClientTLS | None = None,
        use_call_socket: bool = True,
    ) -> None:
        """``chunk_bytes``: the most page bytes one gRPC message carries on the socket path
        (4 KiB to 8 MiB); by default a page up to 4 MiB is one message. ``token``: the bearer
        token of a server with --auth-file; ``tls``: for a server with --tls-cert (see
        kvstore.security.channel: a token goes only over TLS or to a loopback address).
        ``use_call_socket``: take the server's same-host call channel (``calls``) when it offers one,
        and, with shared memory, make the async API's unary calls over it rather than gRPC."""
        check_chunk_bytes(chunk_bytes)
        self._token, self._tls = token, tls
        self.chunk_bytes = chunk_bytes
        self.address = address
        self.namespace = namespace
        self.layout = namespace.layout
        self.use_shm = use_shm
        self.use_call_socket = use_call_socket
        self.timeout_s = deadline_s(timeout_s, "timeout_s")
        self.lease_ms = lease_ms
        self.copy_threads = copy_threads
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.load_bps = 0.0  # measured by layer-wise loads (EWMA)
        self.max_pages = 4096
        # the highest namespace generation an answer named (None: none yet): an engine's request that
        # learned none of its own saves in it, so that an invalidation acknowledged since refuses them (DESIGN §3)
        self.generation_seen: int | None = None
        self.node = ""
        self._runtime: Runtime | None = None
        self._calls = Calls(None)  # every unary call (its runtime and channels set at connect)
        self._transport: Transport | None = None
        self._arena: ArenaMap | None = None
        self._handles: weakref.WeakSet[LayerLoad | LayerSave] = weakref.WeakSet()  # running layer-wise loads/saves

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Starts the I/O runtime, asks the server for its limits and arena, and picks the
        transport: the arena when this host can map it (and ``use_shm``), else streams."""
        self._runtime = runtime = Runtime(self.address, self.timeout_s, token=self._token, tls=self._tls)
        loop = asyncio.get_running_loop()
        try:
            info, identity = await runtime.call(self._open())
        except BaseException:
            await loop.run_in_executor(None, runtime.close)
            raise
        self.node = info.node
        self.max_pages = max(1, info.max_pages_per_request)
        self.namespace = tenant_namespace(self.namespace, identity)
        if self.use_shm:
            self._arena = await loop.run_in_executor(None, map_arena, info, self._token)
        again = ServerAgain(runtime, self._token, info.arena_token if self._arena else None, self._remap)
        blocking = await again.open_channels(info, self.timeout_s) if self.use_call_socket and info.call_socket else None
        self._calls = Calls(runtime, blocking)
        peer = NamespaceServer(runtime, self.namespace.namespace_id, self.layout, layout_msg(LayoutDesc.of(self.layout)),
                    self.max_pages, self.lease_ms, self._calls)
        if self._arena is not None:
            self._transport = ShmTransport(peer, self._arena, self.copy_threads, info.pool_socket, self._token)
            self._transport.relearn = again.arena_again
        else:
            self._transport = StreamTransport(peer, self.chunk_bytes)

    def _remap(self, arena: ArenaMap) -> None:
        """Takes the restarted server's arena (client/restart.py)."""
        cast(ShmTransport, self._transport).remap(arena)
        self._arena = arena

    async def _open(self) -> tuple[Any, Any]:
        """The server's info, and who this client is to it (None without a credential)."""
        runtime = self.runtime
        await runtime.open()
        info = await runtime.rpc(runtime.data.GetInfo, data_pb2.GetInfoRequest())
        credential = self._token is not None or (self._tls is not None and self._tls.cert is not None)
        identity = await runtime.rpc(runtime.data.WhoAmI, data_pb2.WhoAmIRequest()) if credential else None
        return info, identity

    async def close(self) -> None:
        """Abandons the layer-wise loads and saves still running and waits for them (each
        completes once and gives back what it held), cancels the calls in flight and waits
        for their cleanup, then closes the channel, the copy threads and the arena."""
        if self._runtime is not None and self._runtime.on_loop():
            raise KVStoreError("close() must be awaited on the caller's event loop, not on the client's I/O runtime")
        loop = asyncio.get_running_loop()
        # in a forked child the handles' threads and what they hold are the parent's: left alone
        handles = [] if self._runtime is not None and self._runtime.process.forked else list(self._handles)
        for handle in handles:
            handle.abandon("client closed")
        for handle in handles:
            await loop.run_in_executor(None, handle.join, self.timeout_s)
        self._calls.close()
        if self._runtime is not None:
            await loop.run_in_executor(None, self._runtime.close)
        if self._transport is not None:
            self._transport.close()  # closes the arena with it
            self._transport = None
        elif self._arena is not None:
            self._arena.close()
        self._arena = None

    @property
    def runtime(self) -> Runtime:
        """The client's I/O runtime (set at connect): every RPC runs there. A thread that
        must not wait on an event loop runs the client's coroutines with ``runtime.run``."""
        if self._runtime is None:
            raise KVStoreError("the client is not connected")
        return self._runtime

    @property
    def calls(self) -> Calls:
        """The client's unary calls (client/calls.py): ``await calls.unary(name, request)`` from
        any loop, ``calls.call`` / ``calls.post`` from a thread; each takes the call socket or gRPC.
        ``calls.blocking`` is the socket's channel for threads, None where this host cannot use it."""
        return self._calls

    @property
    def transport(self) -> Transport:
        """The transport page bytes take (set at connect)."""
        if self._transport is None:
            raise KVStoreError("the client is not connected")
        return self._transport

    @property
    def arena(self) -> ArenaMap | None:
        """This client's mapping of the server's arena, when pages go through it."""
        return self._arena

    @property
    def shared_memory(self) -> bool:
        """True when page bytes move through the shared arena rather than the socket."""
        return self._arena is not None

    async def _io(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` on the I/O runtime and awaits it here."""
        if self._runtime is None:
            coro.close()  # and ``runtime`` raises
        return await self.runtime.call(coro)

    async def _call(self, method: Callable[..., Any], request: Any) -> Any:
        """One RPC over gRPC whatever the method (a stub's, ``runtime.data.Stats``): for tests and
        tools that must bypass the call socket; the client's own calls take ``calls.unary``."""
        return await self._io(self.runtime.rpc(method, request))

    def keys(self, tokens: Any) -> list[bytes]:
        """The page keys of ``tokens`` (full pages only)."""
        return page_keys(self.namespace.namespace_id, tokens, self.layout.page_tokens)

    # -- lookup / put / get ----------------------------------------------------------------

    async def lookup(self, tokens: Any) -> Hit:
        """The longest stored prefix of ``tokens``."""
        return await self.lookup_keys(self.keys(tokens))

    async def lookup_keys(self, keys: list[bytes], _tries: int = 3) -> Hit:
        """The longest stored prefix of a chain of page keys the engine computed itself (see client/calls.py).
        No keys (a prompt under a page): the server is asked with a key nobody stores, for the generation it reads."""
        runs: list[LocationRun] = []
        n = generation = 0
        if not keys:
            req = directory_pb2.LookupRequest(namespace_id=self.namespace.namespace_id, keys=[bytes(PAGE_KEY_BYTES)])
            generation = int((await self._calls.unary("Directory.Lookup", req)).generation)
            self.saw_generation(generation)
            return Hit(self.namespace.namespace_id, 0, [], [], generation)
        for start in range(0, len(keys), self.max_pages):
            batch = keys[start : start + self.max_pages]
            req = directory_pb2.LookupRequest(namespace_id=self.namespace.namespace_id, keys=batch)
            resp = await self._calls.unary("Directory.Lookup", req)
            if start and resp.generation != generation:  # invalidated between two batches: what came before is dead
                return await self.lookup_keys(keys, _tries - 1) if _tries > 1 else Hit(self.namespace.namespace_id, 0, [], [],
                                                                                        resp.generation)
            generation = resp.generation
            runs.extend(LocationRun(r.node, r.tier, r.num_pages, r.size_bytes) for r in resp.runs)
            n += resp.num_pages
            if resp.num_pages < len(batch):
                break
        self.saw_generation(generation)
        return Hit(self.namespace.namespace_id, n * self.layout.page_tokens, keys[:n], runs, generation)

    def saw_generation(self, generation: int) -> None:
        """Keeps the highest namespace generation an answer named (``generation_seen``)."""
        self.generation_seen = generation if self.generation_seen is None else max(self.generation_seen, generation)

    async def put(self, tokens: Any, kv: torch.Tensor | EngineKV, *, durable: bool = False, wanted: bool = False,
                  session_open: bool = False, replicas: int = 1, generation: int | None = None, session_id: str = "") -> int:
        """Stores the full pages of ``kv`` (``[layers, kv, tokens, heads, dim]``).

        Pages already stored are not written again. With ``durable`` every page of the
        returned prefix, those stored before in RAM included, is on the ssd tier (synced)
        when this returns, or this raises (TierFull, TierUnavailable, or PageMissing with
        ``num_tokens`` durable). ``wanted`` / ``session_open`` tell SSD admission these pages
        will be used again. ``replicas`` (cluster mode): ``replicas`` nodes, this server's
        included, hold every page of the returned prefix when this returns (see
        ``replicate``). ``generation`` (a ``Hit.generation``): the namespace generation ``kv``
        was computed in; once an invalidation raised it, the put is refused (StaleGeneration)
        instead of storing KV of the old one in the new. ``session_id``: the session saved; refused
        (SessionFenced) once a live migration fenced it here. Returns the leading tokens stored (on that many nodes)."""
        return await self.put_keys(self.keys(tokens), kv, durable=durable, wanted=wanted, session_open=session_open,
                                   replicas=replicas, generation=generation, session_id=session_id)

    async def put_keys(self, keys: list[bytes], kv: torch.Tensor | EngineKV, *, durable: bool = False,
                       wanted: bool = False, session_open: bool = False, replicas: int = 1,
                       generation: int | None = None, session_id: str = "") -> int:
        """``put`` for page keys the engine computed itself: page i of ``kv`` is stored under
        ``keys[i]``. Returns the number of leading tokens stored."""
        flags = (FLAG_WANTED if wanted else 0) | (FLAG_SESSION_OPEN if session_open else 0)
        check_engine_kv(kv, self.layout, len(keys) * self.layout.page_tokens, "kv")
        stored = await self._io(self.transport.put(keys, kv, durable, flags, generation, session_id))
        if 0 < stored < len(keys):  # cut short: the put's own tail may have been evicted before it ended
            stored = min(stored, len((await self.lookup_keys(keys[:stored])).keys))
        if replicas != 1 and stored:
            stored = await self.replicate_keys(keys[:stored], replicas)
        return stored * self.layout.page_tokens

    async def get(self, hit: Hit, into: torch.Tensor | EngineKV) -> int:
        """Copies the hit's pages into ``into`` (``[layers, kv, >= hit.num_tokens, heads, dim]``).

        Returns ``hit.num_tokens``. Raises PageMissing or PageCorrupt when a promised page
        cannot be delivered; the leading pages before it are in place (``exc.num_tokens``).
        """
        self._check_hit(hit)
        check_engine_kv(into, self.layout, hit.num_tokens, "into")
        await self._io(self.transport.get(hit.keys, into))
        return hit.num_tokens

    def _check_hit(self, hit: Hit) -> None:
        if hit.namespace_id != self.namespace.namespace_id:
            raise InvalidRequest("the hit belongs to another namespace than this client")

    # -- sessions (live migration: client/migrate.py) ---------------------------------
    def session(self, session_id: str, sync_every: int = 1, sync_ms: float = 50.0, checkpoint: str = "periodic",
                checkpoint_tokens: int = 256) -> SessionLog:
        """The token write-ahead log and KV checkpoint policy of one generation (see
        kvstore.client.session)."""
        return SessionLog(self, session_id, sync_every, sync_ms, checkpoint, checkpoint_tokens)

    async def recover(self, session_id: str) -> Recovery | None:
        """What a crashed generation had returned, how much of its KV is stored, and what
        must be prefilled again; None if the session was never logged (or was ended)."""
        return await recover_session(self, session_id)

    async def append_tokens(self, session_id: str, tokens: list[int], *, expected_length: int, sync: bool,
                            prompt_tokens: int = 0) -> int:
        """Appends ``tokens`` to a session's log, which must hold ``expected_length`` tokens
        (a retry of an append already logged changes nothing; a gap raises InvalidRequest);
        ``sync``: durable before this returns. Returns the log's length."""
        req = data_pb2.AppendTokensRequest(namespace_id=self.namespace.namespace_id, session_id=session_id,
                                           expected_length=expected_length, tokens=token_array(tokens).tolist(), sync=sync,
                                           prompt_tokens=prompt_tokens)
        return int((await self._calls.unary("Data.AppendTokens", req)).length)

    async def read_session(self, session_id: str) -> LoggedSession | None:
        """A session's logged tokens, or None if it was never logged (or was ended)."""
        req = data_pb2.GetSessionRequest(namespace_id=self.namespace.namespace_id, session_id=session_id)
        resp = await self._calls.unary("Data.GetSession", req)
        return LoggedSession(resp.prompt_tokens, list(resp.tokens)) if resp.found else None

    async def end_session(self, session_id: str) -> None:
        """Drops a session's log (its KV pages stay, as any others)."""
        req = data_pb2.EndSessionRequest(namespace_id=self.namespace.namespace_id, session_id=session_id)
        await self._calls.unary("Data.EndSession", req)

    # -- queue hints ---------------------------------------------------------------------

    async def hint(self, tokens: Any, eta_s: float) -> bool:
        """Tells the store a queued request will need ``tokens`` in about ``eta_s`` seconds.
        False means no prefetch space was reserved: recompute rather than wait."""
        return (await self.hint_batch([(tokens, eta_s)]))[0]

    async def hint_batch(self, requests: list[tuple[Any, float]]) -> list[bool]:
        """``hint`` for several queued requests in one RPC; one answer per request (False for
        one shorter than a page: it has no page to prefetch, and is not sent)."""
        entries = [data_pb2.HintEntry(keys=self.keys(tokens)[: self.max_pages], eta_ms=_eta_ms(eta)) for tokens, eta in requests]
        sent = [entry for entry in entries if entry.keys]  # the server refuses an entry without keys
        if not sent:
            return [False] * len(entries)
        req = data_pb2.HintRequest(namespace_id=self.namespace.namespace_id, entries=sent)
        reserved = iter((await self._calls.unary("Data.Hint", req)).reserved)
        return [bool(entry.keys) and next(reserved) for entry in entries]

    # -- layer-wise ----------------------------------------------------------------------

    def load(self, hit: Hit, into: torch.Tensor | EngineKV, ahead: int = 0, deadline_s: float | None = None,
             device_ops: DeviceOps | None = None) -> LayerLoad:
        """Starts a layer-wise load of ``hit`` into the engine's KV and returns at once.
        ``deadline_s`` bounds every wait (default: the estimated time to recompute the hit,
        at least 50 ms); past it the engine is told to recompute. ``device_ops``: the device
        seam of KV on a device (default: read off its tensors; kvstore.device_ops)."""
        self._check_hit(hit)
        if deadline_s is None:
            deadline_s = max(0.05, 2 * hit.num_tokens / self.prefill_tokens_per_s)
        load = LayerLoad(self, hit, as_engine_kv(into, self.layout), ahead, deadline_s, device_ops)
        self._handles.add(load)
        return load

    def save(self, tokens: Any, kv: torch.Tensor | EngineKV, start: int = 0, durable: bool = False,
             session_id: str = "", generation: int | None = None) -> LayerSave:
        """Starts a layer-wise save of the full pages of ``tokens`` from token ``start`` (page-aligned: usually
        ``hit.num_tokens``) on; ``session_id``, ``generation``: as put's; see LayerSave."""
        save = LayerSave(self, tokens, as_engine_kv(kv, self.layout), start, durable, session_id, generation)
        self._handles.add(save)
        return save

    def suggest_ahead(self, hit_tokens: int, new_tokens: int, compute_s_per_token: float | None = None,
                      bandwidth_bps: float | None = None) -> int:
        """Layers to load before compute starts: S_buf = B·(T_read − T_new) in whole layers,
        with B measured by earlier loads (or given) and T_new from the prefill speed."""
        from kvstore import planner

        bandwidth = bandwidth_bps or self.load_bps or 5e9
        per_token = compute_s_per_token or 1.0 / self.prefill_tokens_per_s
        read_s = hit_tokens * self.layout.bytes_per_token / bandwidth
        return planner.preload_layers(self.layout.num_layers, bandwidth, read_s, new_tokens * per_token)

    def record_load(self, num_bytes: int, seconds: float) -> None:
        """Feeds a finished load's bandwidth into ``load_bps`` (an EWMA)."""
        if num_bytes and seconds > 0:
            bps = num_bytes / seconds
            self.load_bps = bps if not self.load_bps else 0.7 * self.load_bps + 0.3 * bps
