"""The calls a chaos worker makes, each recorded as an ``Op``: through the public client
(put, lookup + get, invalidate, hint, put with replicas, a direct handoff of a layer-wise save)
and raw gRPC where the check is that the server refuses (key-level invalidation in cluster
mode, another tenant's probe)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
import torch

from kvstore import Namespace
from kvstore._proto import data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.bench.chaos.chaos_cluster import TENANTS, ChaosCluster
from kvstore.bench.chaos.history import Op
from kvstore.bench.chaos.model import LAYOUT, page_digests, prefix_kv
from kvstore.client import KVStoreClient, new_handoff_id
from kvstore.errors import KVStoreError
from kvstore.page_wire.grpc_chunks import CLIENT_OPTIONS
from kvstore.security.channel import call_metadata

if TYPE_CHECKING:
    from kvstore.bench.chaos.traffic import Planned
    from kvstore.client.hit import Hit

logger = logging.getLogger(__name__)

# RPC rounds each kind makes (lookup: 1, get: acquire + release, put: allocate + commit, a
# replicated put: + Replicate): its deadline budget is rounds x timeout_s (+ validate.MARGIN_S)
ROUNDS = {"lookup": 1, "read": 3, "put": 2, "replicate": 3, "hint": 1, "invalidate": 1, "key_invalidate": 1, "probe": 2,
          "handoff": 7}  # open, allocate, commit, complete, wait, acquire, release
HANDOFF_TTL_S = 10.0  # a handoff whose save was refused or whose wait failed: its marker goes after this
HUNG_S = 10.0  # past its budget by this much, a call is abandoned and recorded as "Hung"
TOKENS = {t.name: t.token for t in TENANTS}


class Clients:
    """One client per (tenant, node, namespace), opened at the history's start; one in three
    reads over gRPC streams instead of shared memory. A client whose call failed other than
    with a KVStoreError (or hung) is replaced before its next call."""

    def __init__(self, cluster: ChaosCluster, namespaces: list[str], timeout_s: float) -> None:
        self.cluster = cluster
        self.namespaces = namespaces
        self.timeout_s = timeout_s
        self._clients: dict[tuple[str, str, str], KVStoreClient] = {}
        self._connecting: defaultdict[tuple[str, str, str], asyncio.Lock] = defaultdict(asyncio.Lock)
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def open(self) -> None:
        keys = [(t.name, n.name, ns) for t in TENANTS for n in self.cluster.nodes for ns in self.namespaces]
        await asyncio.gather(*(self.get(*key) for key in keys), return_exceptions=True)  # a failed one: again at its first call

    async def get(self, tenant: str, node: str, namespace: str) -> KVStoreClient:
        key = (tenant, node, namespace)
        async with self._connecting[key]:  # two workers needing it at once: one client
            client = self._clients.get(key)
            if client is None:
                index = ([t.name for t in TENANTS].index(tenant) + self.namespaces.index(namespace)
                         + [n.name for n in self.cluster.nodes].index(node))
                client = KVStoreClient(self.cluster.node(node).address, Namespace(model=namespace, revision="r1", layout=LAYOUT),
                                       token=TOKENS[tenant], timeout_s=self.timeout_s, copy_threads=1, use_shm=index % 3 != 0)
                client.push_layers_min_bytes = 0  # a history's saves are a few small pages: their layers go ahead all the same
                await client.connect()
                self._clients[key] = client
        return client

    async def drop(self, tenant: str, node: str, namespace: str) -> None:
        client = self._clients.pop((tenant, node, namespace), None)
        if client is not None:
            try:
                await client.close()
            except Exception:  # a broken client is thrown away whatever its close says
                logger.exception("closing a chaos client failed")

    async def invalidate_all(self) -> None:
        """Every namespace of the history invalidated, at every node (where it is bound
        matters, see the README's found-by table): their pages leave the tiers, so a run of
        hundreds of histories never fills the SSD (an eviction would look like a lost page)."""
        calls = [self.get(t.name, n.name, ns) for t in TENANTS for n in self.cluster.nodes for ns in self.namespaces]
        clients = [c for c in await asyncio.gather(*calls, return_exceptions=True) if isinstance(c, KVStoreClient)]
        await asyncio.gather(*(c.invalidate() for c in clients), return_exceptions=True)

    def channel(self, node: str) -> grpc.aio.Channel:
        if node not in self._channels:
            self._channels[node] = grpc.aio.insecure_channel(self.cluster.node(node).address, options=CLIENT_OPTIONS)
        return self._channels[node]

    async def close(self) -> None:
        for key in list(self._clients):
            await self.drop(*key)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


async def _get(client: KVStoreClient, hit: Hit, op: Op) -> None:
    """Reads ``hit``: ``op.result`` the tokens read, ``op.pages`` the digest of each page in place
    (the leading pages of a get cut short too)."""
    out = torch.zeros((LAYOUT.num_layers, LAYOUT.kv_factor, hit.num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                      dtype=LAYOUT.torch_dtype())
    try:
        op.result = await client.get(hit, out)
    except KVStoreError as exc:
        op.pages = page_digests(out, int(getattr(exc, "num_tokens", 0)) // LAYOUT.page_tokens)
        raise
    op.pages = page_digests(out, op.result // LAYOUT.page_tokens)


def error_name(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"grpc.{exc.code().name}"
    return type(exc).__name__


def _detail(exc: BaseException) -> str:
    text = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
    return (text or "")[:200]


class Calls:
    """One worker's calls. ``known``: the generation it last learned per (tenant, namespace)."""

    def __init__(self, clients: Clients, worker: int, known: dict[tuple[str, str], int], record: Callable[[Op], None]) -> None:
        self.clients = clients
        self.worker = worker
        self.known = known
        self.record = record
        self._bodies: dict[str, Callable[[Planned, list[int], Op], Awaitable[object]]] = {
            "lookup": self._lookup, "put": self._put, "replicate": self._put, "read": self._read, "hint": self._hint,
            "invalidate": self._invalidate, "key_invalidate": self._key_invalidate, "probe": self._probe,
            "handoff": self._handoff}

    async def do(self, p: Planned, tokens: list[int]) -> None:
        if p.kind == "put" and p.lookup_first:
            await self._run(p, tokens, "lookup")
        await self._run(p, tokens, p.kind)

    async def _run(self, p: Planned, tokens: list[int], kind: str) -> None:
        """One call, its start/end on the monotonic clock and its error class recorded."""
        op = Op(worker=self.worker, kind=kind, tenant=p.tenant, namespace=p.namespace, node=p.node, root=p.root,
                num_pages=p.num_pages, durable=p.durable and kind == "put", replicas=2 if kind == "replicate" else 1)
        op.start = time.monotonic()
        try:
            await asyncio.wait_for(self._bodies[kind](p, tokens, op), ROUNDS[kind] * self.clients.timeout_s + HUNG_S)
        except TimeoutError:
            op.error = "Hung"
            await self.clients.drop(op.tenant, op.node, op.namespace)
        except (KVStoreError, grpc.aio.AioRpcError) as exc:
            op.error, op.detail = error_name(exc), _detail(exc)
            if op.result is None and hasattr(exc, "num_tokens"):  # a short get or durable put: what is in place
                op.result = int(exc.num_tokens)
        except Exception as exc:  # noqa: BLE001 - any other failure is recorded; the client is replaced
            logger.warning("chaos call %s failed unexpectedly: %r", kind, exc)
            op.error, op.detail = error_name(exc), _detail(exc)
            await self.clients.drop(op.tenant, op.node, op.namespace)
        op.end = time.monotonic()
        self.record(op)

    async def _lookup(self, p: Planned, tokens: list[int], op: Op) -> Hit:
        client = await self.clients.get(p.tenant, p.node, p.namespace)
        hit = await client.lookup(tokens)
        op.hit_tokens, op.generation = hit.num_tokens, hit.generation
        op.keys = [k.hex() for k in hit.keys]
        self.known[(p.tenant, p.namespace)] = hit.generation
        return hit

    async def _read(self, p: Planned, tokens: list[int], op: Op) -> None:
        hit = await self._lookup(p, tokens, op)
        op.result = 0
        if hit.num_tokens == 0:
            return
        await _get(await self.clients.get(p.tenant, p.node, p.namespace), hit, op)

    async def _handoff(self, p: Planned, tokens: list[int], op: Op) -> None:
        """A direct handoff from ``p.node`` to another node (``op.to_node``), opened with the
        prompt's keys; a layer-wise save naming the generation the worker knows, its first layer
        said before the others (``op.saved``: the tokens it stored); the complete; the wait and
        the read at the decode node as the same tenant (``op.pages``, checked as a read's)."""
        nodes = [n.name for n in self.clients.cluster.nodes]
        op.to_node = nodes[(nodes.index(p.node) + 1 + p.root % (len(nodes) - 1)) % len(nodes)]
        prefill = await self.clients.get(p.tenant, p.node, p.namespace)
        keys = prefill.keys(tokens)
        op.keys = [k.hex() for k in keys]
        op.generation = self.known.get((p.tenant, p.namespace), 0)
        ident = new_handoff_id()
        await prefill.handoff_open(ident, op.to_node, HANDOFF_TTL_S, tokens=keys)
        save = prefill.save(tokens, prefix_kv(p.tenant, p.namespace, op.generation, keys), generation=op.generation)
        save.layer_done(0)
        await asyncio.sleep(p.eta_s / 20)  # the first layer goes ahead while "the model" computes the next
        op.saved = await save.finished()
        await prefill.handoff_complete(ident, keys)
        decode = await self.clients.get(p.tenant, op.to_node, p.namespace)
        hit = await decode.handoff_wait(ident, keys, deadline_s=self.clients.timeout_s)
        op.hit_tokens, op.result = hit.num_tokens, 0
        if hit.num_tokens:
            await _get(decode, hit, op)

    async def _put(self, p: Planned, tokens: list[int], op: Op) -> None:
        client = await self.clients.get(p.tenant, p.node, p.namespace)
        keys = client.keys(tokens)
        op.generation = self.known.get((p.tenant, p.namespace), 0)
        op.keys = [k.hex() for k in keys]
        kv = prefix_kv(p.tenant, p.namespace, op.generation, keys)
        op.result = await client.put(tokens, kv, durable=op.durable, replicas=op.replicas, generation=op.generation)

    async def _invalidate(self, p: Planned, tokens: list[int], op: Op) -> None:
        client = await self.clients.get(p.tenant, p.node, p.namespace)
        op.result = op.generation = await client.invalidate()
        self.known[(p.tenant, p.namespace)] = op.generation

    async def _hint(self, p: Planned, tokens: list[int], op: Op) -> None:
        client = await self.clients.get(p.tenant, p.node, p.namespace)
        op.result = int(await client.hint(tokens, p.eta_s))

    async def _key_invalidate(self, p: Planned, tokens: list[int], op: Op) -> None:
        """Raw, as the namespace's own tenant: cluster mode refuses it (INVALID_ARGUMENT); result 1 if it was taken."""
        client = await self.clients.get(p.tenant, p.node, p.namespace)
        keys = client.keys(tokens)
        op.keys = [k.hex() for k in keys]
        stub = directory_pb2_grpc.DirectoryStub(self.clients.channel(p.node))
        request = directory_pb2.InvalidateRequest(namespace_id=client.namespace.namespace_id, keys=keys)
        await stub.Invalidate(request, metadata=call_metadata(TOKENS[p.tenant]), timeout=self.clients.timeout_s)
        op.result = 1

    async def _probe(self, p: Planned, tokens: list[int], op: Op) -> None:
        """The other tenant asks, with its own token, for ``p.tenant``'s namespace id and keys:
        result = pages its lookup promised + pages its acquire leased (must be 0)."""
        victim = await self.clients.get(p.tenant, p.node, p.namespace)
        keys = victim.keys(tokens)
        op.keys = [k.hex() for k in keys]
        prober = next(t for t in TENANTS if t.name != p.tenant)
        channel, metadata, timeout = self.clients.channel(p.node), call_metadata(prober.token), self.clients.timeout_s
        namespace_id = victim.namespace.namespace_id
        lookup = await directory_pb2_grpc.DirectoryStub(channel).Lookup(
            directory_pb2.LookupRequest(namespace_id=namespace_id, keys=keys), metadata=metadata, timeout=timeout)
        acquired = await data_pb2_grpc.DataStub(channel).Acquire(
            data_pb2.AcquireRequest(namespace_id=namespace_id, keys=keys), metadata=metadata, timeout=timeout)
        op.result = int(lookup.num_pages) + len(acquired.pages)
