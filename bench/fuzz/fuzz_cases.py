"""Valid requests for the fuzzer, built from what the run has seen, and what each answer
teaches.

Each tenant's ``Pools`` hold real namespace ids, keys of stored pages, live allocation and
lease handles (with the token that got each, to give it back at the end), released ones,
and sessions. ``VALID`` builds a valid request per RPC from them; an RPC without an entry
(a new one) gets a typed random message (fuzz_mutate.fill) and is still fuzzed.
``learn`` reads an OK answer: handles to reuse and release, pages now stored.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message

from kvstore._proto import common_pb2, data_pb2, directory_pb2
from kvstore.client.arena import ArenaMap
from kvstore.page import checksum
from kvstore.page_wire.grpc_chunks import page_chunks
from kvstore.types import DTYPE_BYTES

FRESH_ALLOCATION_S = 20.0  # slots of an older allocation are not read (it may have expired and been reused)


@dataclass
class Allocation:
    keys: list[bytes]
    offsets: list[int | None]  # None: stored already
    page_bytes: int
    token: str  # who got it
    created_s: float = field(default_factory=time.monotonic)


@dataclass
class Pools:
    """What one tenant's calls have seen. ``other`` is set to the other tenant's pools."""

    tenant: str
    token: str
    namespace_id: bytes
    layout: common_pb2.Layout
    page_bytes: int
    keys: list[bytes] = field(default_factory=list)
    allocations: dict[bytes, Allocation] = field(default_factory=dict)
    leases: dict[bytes, str] = field(default_factory=dict)  # lease id -> token that got it
    released: list[bytes] = field(default_factory=list)
    sessions: dict[str, int] = field(default_factory=dict)  # session id -> tokens logged
    other: Pools | None = None

    def _pick(self, own: list[Any], rng: random.Random, foreign: list[Any] | None = None) -> Any:
        if foreign and rng.random() < 0.2:
            return rng.choice(foreign)
        return rng.choice(own) if own else None

    def stored_keys(self, rng: random.Random, count: int) -> list[bytes]:
        """``count`` keys in a row of stored pages when there are some (a prefix-like run)."""
        if not self.keys:
            return [rng.randbytes(16) for _ in range(count)]
        start = rng.randrange(len(self.keys))
        return self.keys[start : start + count]

    # -- fuzz_mutate.Values ---------------------------------------------------------------

    def bytes_for(self, name: str, rng: random.Random) -> bytes | None:
        other = self.other
        roll = rng.random()
        if name == "namespace_id":
            if roll < 0.6:
                return self.namespace_id
            if roll < 0.8 and other is not None:
                return other.namespace_id
            return rng.randbytes(rng.choice((16, 16, 0, 15, 17, 32)))
        if name in ("key", "keys"):
            key = self._pick(self.keys, rng, other.keys if other else None) if roll < 0.65 else None
            return key if key is not None else rng.randbytes(16)
        if name in ("lease_id", "allocation_id"):
            own = list(self.leases) if name == "lease_id" else list(self.allocations)
            foreign = (list(other.leases) if name == "lease_id" else list(other.allocations)) if other else []
            if roll < 0.6 and (own or foreign):
                return self._pick(own or foreign, rng, foreign)
            if roll < 0.8 and self.released:
                return rng.choice(self.released)
            return rng.randbytes(rng.choice((16, 0, 8, 32)))
        return None

    def string_for(self, name: str, rng: random.Random) -> str | None:
        if name == "session_id":
            foreign = list(self.other.sessions) if self.other else []
            return self._pick(list(self.sessions), rng, foreign) or f"s-{rng.randrange(1000)}"
        if name == "tier":
            return rng.choice(("", "host", "ssd", "hbm", "remote", "tape", "HOST"))
        if name == "node":
            return rng.choice(("peer-1", "peer-2", "local", "", "n" * 256))
        if name == "dtype":
            return rng.choice([*DTYPE_BYTES, "float64", "", "FLOAT16"])
        return None


def _keys(pools: Pools, rng: random.Random) -> list[bytes]:
    return pools.stored_keys(rng, rng.randint(1, 8))


def _allocate(p: Pools, rng: random.Random, arena: ArenaMap | None) -> Message:
    keys = [rng.randbytes(16) for _ in range(rng.randint(1, 4))]
    if p.keys and rng.random() < 0.3:
        keys = p.stored_keys(rng, 2) + keys  # pages stored already come back as `exists`
    return data_pb2.AllocateRequest(namespace_id=p.namespace_id, layout=p.layout, keys=keys)


def _commit(p: Pools, rng: random.Random, arena: ArenaMap | None) -> Message:
    """Commits a live allocation, with the checksums of what its slots hold (read from the
    arena when this process maps it; never written: a slot may have been reused) or random."""
    fresh = [(i, a) for i, a in p.allocations.items() if time.monotonic() - a.created_s < FRESH_ALLOCATION_S]
    if not fresh:
        return data_pb2.CommitRequest(allocation_id=rng.randbytes(16), keys=[rng.randbytes(16)], checksums=[1])
    ident, alloc = rng.choice(fresh)
    written = [(k, o) for k, o in zip(alloc.keys, alloc.offsets) if o is not None]
    sums = [checksum(arena.array[o : o + alloc.page_bytes]) if arena is not None and rng.random() < 0.8 else rng.getrandbits(64)
            for _, o in written]
    return data_pb2.CommitRequest(allocation_id=ident, keys=[k for k, _ in written], checksums=sums, durable=rng.random() < 0.2,
                                  flags=rng.choice((0, 1, 2, 3)))


def _handle(kind: str) -> Callable[[Pools, random.Random, ArenaMap | None], Message]:
    def build(p: Pools, rng: random.Random, arena: ArenaMap | None) -> Message:
        own = list(p.allocations if kind == "allocation" else p.leases)
        ident = rng.choice(own) if own else rng.randbytes(16)
        if kind == "allocation":
            return data_pb2.AbortRequest(allocation_id=ident)
        if kind == "release":
            return data_pb2.ReleaseRequest(lease_id=ident)
        return data_pb2.RenewRequest(lease_id=ident, ttl_ms=rng.choice((0, 1000, 5000)))

    return build


def _session(p: Pools, rng: random.Random) -> str:
    return rng.choice(list(p.sessions)) if p.sessions and rng.random() < 0.7 else f"fuzz-{rng.randrange(10**6)}"


def _append(p: Pools, rng: random.Random, arena: ArenaMap | None) -> Message:
    sid = _session(p, rng)
    length = p.sessions.get(sid, 0)
    tokens = [rng.randrange(150_000) for _ in range(rng.randint(1, 64))]
    return data_pb2.AppendTokensRequest(namespace_id=p.namespace_id, session_id=sid, expected_length=length, tokens=tokens,
                                        sync=rng.random() < 0.2, prompt_tokens=len(tokens) if not length else 0)


# RPC name -> a valid request of the caller's own tenant (unary and server-streaming RPCs).
VALID: dict[str, Callable[[Pools, random.Random, ArenaMap | None], Message]] = {
    "GetInfo": lambda p, rng, a: data_pb2.GetInfoRequest(),
    "Allocate": _allocate,
    "Commit": _commit,
    "Abort": _handle("allocation"),
    "Acquire": lambda p, rng, a: data_pb2.AcquireRequest(namespace_id=p.namespace_id, keys=_keys(p, rng),
                                                         ttl_ms=rng.choice((0, 500, 5000))),
    "Release": _handle("release"),
    "Renew": _handle("renew"),
    "ReadPages": lambda p, rng, a: data_pb2.ReadPagesRequest(namespace_id=p.namespace_id, keys=_keys(p, rng),
                                                             chunk_bytes=rng.choice((0, 4096, 10_000)), ttl_ms=rng.choice((0, 5000))),
    "Hint": lambda p, rng, a: data_pb2.HintRequest(namespace_id=p.namespace_id, entries=[
        data_pb2.HintEntry(keys=_keys(p, rng), eta_ms=rng.choice((0, 100, 2000))) for _ in range(rng.randint(1, 3))]),
    "AppendTokens": _append,
    "GetSession": lambda p, rng, a: data_pb2.GetSessionRequest(namespace_id=p.namespace_id, session_id=_session(p, rng)),
    "EndSession": lambda p, rng, a: data_pb2.EndSessionRequest(namespace_id=p.namespace_id, session_id=_session(p, rng)),
    "Replicate": lambda p, rng, a: data_pb2.ReplicateRequest(namespace_id=p.namespace_id, keys=_keys(p, rng), replicas=1),
    "GrantTransfer": lambda p, rng, a: data_pb2.GrantTransferRequest(node=f"peer-{rng.randrange(3)}"),
    "Lookup": lambda p, rng, a: directory_pb2.LookupRequest(namespace_id=p.namespace_id, keys=_keys(p, rng)),
    "Publish": lambda p, rng, a: directory_pb2.PublishRequest(namespace_id=p.namespace_id, records=[
        directory_pb2.PageRecord(key=rng.randbytes(16), location=common_pb2.Location(
            node=f"peer-{rng.randrange(3)}", tier=rng.choice(("ssd", "host", "remote")), size_bytes=p.page_bytes))
        for _ in range(rng.randint(1, 4))]),
    "Remove": lambda p, rng, a: directory_pb2.RemoveRequest(namespace_id=p.namespace_id, keys=_keys(p, rng)[:1],
                                                            tier=rng.choice(("", "host", "remote"))),
    "Invalidate": lambda p, rng, a: directory_pb2.InvalidateRequest(namespace_id=p.namespace_id, keys=_keys(p, rng)[:2]),
    "Subscribe": lambda p, rng, a: directory_pb2.SubscribeRequest(from_seq=rng.choice((0, 1, 10))),
    "Stats": lambda p, rng, a: directory_pb2.StatsRequest(),
    "Quarantine": lambda p, rng, a: directory_pb2.QuarantineRequest(purge=rng.random() < 0.1),
}


def write_pages_stream(p: Pools, rng: random.Random) -> tuple[list[bytes], list[bytes]]:
    """A valid WritePages stream: 1 to 3 pages (new keys, or stored ones) cut into chunks;
    returns (encoded chunks, the pages' keys in order)."""
    keys = [rng.randbytes(16) if rng.random() < 0.8 or not p.keys else rng.choice(p.keys) for _ in range(rng.randint(1, 3))]
    chunk_bytes = rng.choice((4096, 8192, max(4096, p.page_bytes)))
    chunks: list[bytes] = []
    for key in keys:
        chunks += page_chunks(key, p.namespace_id, p.layout, rng.randbytes(p.page_bytes), None, durable=rng.random() < 0.1,
                              chunk_bytes=chunk_bytes, flags=rng.choice((0, 1)))
    return chunks, keys


def learn(p: Pools, method: str, request: Message | None, response: Message, token: str, page_keys: list[bytes]) -> None:
    """Updates ``p`` from the OK answer ``response`` to ``request`` (None: it did not parse)."""
    if isinstance(response, data_pb2.AllocateResponse) and response.allocation_id:
        p.allocations[response.allocation_id] = Allocation([s.key for s in response.slots],
                                                           [None if s.exists else s.offset for s in response.slots],
                                                           response.page_bytes, token)
    elif isinstance(response, data_pb2.AcquireResponse) and response.lease_id:
        p.leases[response.lease_id] = token
    elif method in ("Commit", "Abort") and request is not None:
        alloc = p.allocations.get(request.allocation_id)
        if alloc is not None and alloc.token == token:  # another tenant's call is answered as for an unknown handle
            del p.allocations[request.allocation_id]
            p.released.append(request.allocation_id)
        if method == "Commit":
            p.keys.extend(request.keys[: response.num_published])
    elif method == "Release" and request is not None:
        if p.leases.get(request.lease_id) == token:  # only its maker's release ends a lease
            del p.leases[request.lease_id]
            p.released.append(request.lease_id)
    elif method == "WritePages":
        p.keys.extend(page_keys[: response.num_published])
    elif method == "AppendTokens" and request is not None:
        p.sessions[request.session_id] = response.length
    elif method == "EndSession" and request is not None:
        p.sessions.pop(request.session_id, None)
    del p.keys[:-4096]  # bounded: recent pages are the likeliest still stored
    del p.released[:-256]
