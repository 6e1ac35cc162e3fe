"""The contract every transport keeps, and the page copies they share.

A transport is one path page bytes take between the engine's KV and the server: shared
memory (the server's arena) or a gRPC stream; UCX or CUDA IPC would be one more class.
put, get, layer-wise load, layer-wise save and session checkpoints all go through the
one transport a client picked at connect, so none of them branches on the path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvstore._proto import common_pb2
from kvstore.client.engine_kv import EngineKV
from kvstore.client.pages import check_kv, copy_bytes, page_of
from kvstore.errors import InvalidRequest
from kvstore.types import KVLayout

if TYPE_CHECKING:
    from kvstore.client.calls import Calls
    from kvstore.client.runtime import Runtime


@dataclass(frozen=True)
class NamespaceServer:
    """The server a transport talks to, as one namespace sees it."""

    runtime: Runtime
    namespace_id: bytes
    layout: KVLayout
    layout_msg: common_pb2.Layout
    max_pages: int  # the most keys one request may carry (the server's limit)
    lease_ms: int  # lease term asked for reads (0: the server's default)
    calls: Calls  # its unary calls (call socket or gRPC)


class Staged(Protocol):
    """Pages of a hit held for a layer-wise load.

    ``fill`` holds the longest prefix of ``keys`` it can get (leased in place, or streamed
    and verified) within ``timeout_s``; then ``pages[i]`` is page i's bytes (uint8, one
    page in the layout's byte order, read layer by layer) and ``checksums[i]`` what they
    must hash to. ``verify`` counts the leading pages whose bytes still hold their checksum.
    ``renew`` keeps what is held for another lease term and raises LeaseExpired when it is
    gone already (its bytes may have been reused). ``release`` gives everything back; it
    is idempotent and never raises. All but ``verify`` run on the runtime loop."""

    pages: list[torch.Tensor]
    checksums: list[int]

    async def fill(self, keys: list[bytes], timeout_s: float) -> None: ...

    def verify(self) -> int: ...

    async def renew(self, timeout_s: float) -> None: ...

    async def release(self) -> None: ...


class Outgoing(Protocol):
    """Page buffers for a layer-wise save, published all at once.

    After ``reserve(keys)``, ``buffers[j]`` (uint8, one page) is to hold page
    ``indices[j]`` of ``keys`` (pages the server already has are left out) and ``asked``
    is how many leading pages a publish covers. ``publish`` stores them with their
    checksums and returns the server's ``num_published``; ``discard`` gives back what was
    reserved and not published (idempotent, never raises). What is reserved is kept for
    ``term_s`` unless ``renew`` is called (LeaseExpired: it is gone, never write into it)."""

    buffers: list[torch.Tensor]
    indices: list[int]
    asked: int

    async def reserve(self, keys: list[bytes], parent: bytes = b"") -> None:
        """Slots for ``keys``; ``parent``: the page before ``keys[0]`` in its prefix."""

    async def publish(self, checksums: list[int], durable: bool) -> int: ...

    async def discard(self) -> None: ...

    @property
    def term_s(self) -> float: ...

    async def renew(self, timeout_s: float) -> None: ...

    async def written(self, layers: int, timeout_s: float) -> None:
        """Says that the leading ``layers`` of every reserved page are stored in its buffer
        (a server that reserved slots pushes them on to a handoff's decode node, DESIGN §12.7);
        a transport that reserves nothing there ignores it."""


class Transport(Protocol):
    """One path for page bytes. Coroutines run on the client's runtime loop.

    * ``put`` stores page i of ``kv`` under ``keys[i]`` (pages already stored are not sent
      again) and returns how many leading pages are stored. TierFull before the first page
      raises; later, the prefix stored so far is returned. ``durable``: the returned prefix
      is on ssd (synced) or PageMissing (``num_tokens``: the durable prefix) is raised.
    * ``get`` places every page of ``keys`` into ``into``, each verified against its
      checksum, or raises PageMissing / PageCorrupt with ``num_tokens``, the leading valid
      tokens; no unverified byte is left in ``into``, and no copy runs once it returned.
    * ``session_id`` (put, outgoing): the session whose pages are saved, named to the server,
      which refuses the save (SessionFenced) once a live migration fenced the session there.
    * ``generation`` (put, outgoing): the namespace generation the KV was computed in (None: the
      server's current); refused (StaleGeneration) once an invalidation raised it.
    * ``staged`` / ``outgoing``: empty holders for layer-wise loads and saves; ``staged(on_device=True)``
      for a load that copies on a device (pages the server placed in this client's hbm pool
      are then read from there).
    * ``close`` stops its copy threads (nothing may be in flight)."""

    async def put(self, keys: list[bytes], kv: torch.Tensor | EngineKV, durable: bool, flags: int,
                  generation: int | None = None, session_id: str = "") -> int: ...

    async def get(self, keys: list[bytes], into: torch.Tensor | EngineKV) -> None: ...

    def staged(self, on_device: bool = False) -> Staged: ...

    def outgoing(self, session_id: str = "", generation: int | None = None) -> Outgoing: ...

    def close(self) -> None: ...


def check_engine_kv(kv: torch.Tensor | EngineKV, layout: KVLayout, tokens: int, name: str) -> None:
    """Raises InvalidRequest unless ``kv`` is of the layout and holds ``tokens`` tokens."""
    if isinstance(kv, torch.Tensor):
        check_kv(kv, layout, tokens, name)
    elif kv.num_tokens < tokens:
        raise InvalidRequest(f"{name} holds {kv.num_tokens} tokens, {tokens} are needed")


def page_in(dst: torch.Tensor, kv: torch.Tensor | EngineKV, page: int, layout: KVLayout) -> None:
    """dst (one page, layer-major) <- page ``page`` of the engine's KV."""
    if isinstance(kv, torch.Tensor):
        copy_bytes(dst, page_of(kv, page, layout.page_tokens))
    else:
        for layer in range(layout.num_layers):
            dst[layer].copy_(kv.read_layer(page, layer))


def page_out(into: torch.Tensor | EngineKV, page: int, src: torch.Tensor, layout: KVLayout) -> None:
    """Page ``page`` of the engine's KV <- src (one page, layer-major)."""
    if isinstance(into, torch.Tensor):
        copy_bytes(page_of(into, page, layout.page_tokens), src)
    else:
        for layer in range(layout.num_layers):
            into.write_layer(page, layer, src[layer])
