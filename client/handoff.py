"""Prefill -> decode handoff calls (DESIGN §12.7), mixed into KVStoreClient.

More: client/README.md (### handoff.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore._proto import handoff_pb2
from kvstore.client.hit import Hit
from kvstore.errors import InvalidRequest
from kvstore.page import LayoutDesc
from kvstore.types import LocationRun
from kvstore.validate import deadline_s as check_deadline

if TYPE_CHECKING:
    from kvstore.client.calls import Calls
    from kvstore.types import KVLayout, Namespace

HANDOFF_ID_HEX = 32
_MARGIN_S = 1.0  # the wait's RPC deadline beyond the wait's own


def new_handoff_id() -> str:
    """A handoff id: 128 random bits, as hex (unguessable: it is the handoff's only name)."""
    return secrets.token_hex(HANDOFF_ID_HEX // 2)


def _id_bytes(handoff_id: str) -> bytes:
    try:
        raw = bytes.fromhex(handoff_id)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != HANDOFF_ID_HEX // 2:
        raise InvalidRequest(f"handoff_id must be {HANDOFF_ID_HEX} hex digits (new_handoff_id()), got {handoff_id!r}")
    return raw

MAX_PUSHING = 256  # direct handoffs a client remembers as open (their layer-wise saves say each layer)
# A layer-wise save smaller than this says no layer (DESIGN §12.7): its layers going ahead save a handoff
# little and cost the prefill a few hops per layer. kvstore-bench pd, 4-layer model on 2 cores: at 4 MiB,
# direct TTFT 80-83 ms with them against 56-62 ms colocated, the handoff 6.4-7.0 ms either way; at 16 MiB
# the handoff 8.0-8.3 ms with them, 10.1-10.6 without, TTFT within the colocated runs' spread.
PUSH_LAYERS_MIN_BYTES = 8 << 20


class HandoffCalls:
    """Mixed into KVStoreClient, whose ``namespace``, ``layout``, ``calls``, ``node`` and ``keys`` these use."""

    namespace: Namespace
    layout: KVLayout
    calls: Calls
    node: str
    timeout_s: float
    keys: Callable[[Any], list[bytes]]
    push_layers_min_bytes: int = PUSH_LAYERS_MIN_BYTES  # a layer-wise save of fewer new bytes says no layer

    def _page_keys(self, tokens_or_keys: Any) -> list[bytes]:
        """Page keys as given (a list of bytes), or computed from tokens (full pages only)."""
        if isinstance(tokens_or_keys, list) and tokens_or_keys and isinstance(tokens_or_keys[0], bytes):
            return tokens_or_keys
        return self.keys(tokens_or_keys)

    async def handoff_open(self, handoff_id: str, to_node: str | None, ttl_s: float = 30.0, *, tokens: Any = None,
                           push_layers: bool = True) -> None:
        """Prefill side, before or while the prompt's KV is saved: registers the handoff at this
        client's node, to be handed to node ``to_node`` (None: through the pool, the decode node
        finds the pages by lookup). With ``tokens`` (or their page keys), each page of them is
        pushed to ``to_node`` as soon as it is stored here, whatever call stores it; without,
        the pages go at ``handoff_complete``. ``push_layers`` (with ``tokens``): this client's
        layer-wise saves of them say each layer stored, and its bytes go while later layers
        compute (DESIGN §12.7). Forgotten after ``ttl_s`` without a complete.
        RESOURCE_EXHAUSTED (LimitExceeded) past the tenant's open handoffs at the node."""
        keys = self._page_keys(tokens) if tokens is not None else []
        request = handoff_pb2.OpenHandoffRequest(namespace_id=self.namespace.namespace_id, handoff_id=_id_bytes(handoff_id),
                                                 to_node=to_node or "", ttl_ms=_ttl_ms(ttl_s), keys=keys)
        pushing = self._pushing_handoffs()
        if to_node and keys and push_layers:  # before the call: a save's first layer, written meanwhile, is said to the node
            pushing[handoff_id] = frozenset(keys)
            while len(pushing) > MAX_PUSHING:
                pushing.pop(next(iter(pushing)))
        try:
            await self.calls.unary("Handoff.Open", request)
        except BaseException:
            pushing.pop(handoff_id, None)
            raise

    def _pushing_handoffs(self) -> dict[str, frozenset[bytes]]:
        """The page keys of the direct handoffs this client opened and has not completed (the
        newest ``MAX_PUSHING``)."""
        if "_pushing" not in self.__dict__:
            self.__dict__["_pushing"] = {}
        pushing: dict[str, frozenset[bytes]] = self.__dict__["_pushing"]
        return pushing

    def pushes(self, keys: list[bytes]) -> bool:
        """Whether a direct handoff this client opened covers ``keys`` (a layer-wise save of them
        then says each layer it stored, so that the node pushes layers while later ones compute:
        DESIGN §12.7)."""
        return bool(keys) and any(keys[0] in opened for opened in list(self._pushing_handoffs().values()))

    async def handoff_complete(self, handoff_id: str, tokens_or_keys: Any, to_node: str | None = None, *,
                               deadline_s: float | None = None) -> int:
        """Prefill side, once every page of the prompt is stored at this client's node: hands
        the full set to the decode node (``to_node``, else the one ``handoff_open`` named),
        which fetches what it lacks and marks the handoff complete. Returns the number of
        tokens handed off: the leading pages the decode node holds (through the pool: the
        leading pages stored here, findable by lookup). Raises TierUnavailable when the decode
        node is not a member or did not answer within the client's deadline; the pages stay
        here (a retry with ``to_node=None`` hands them through the pool). The handoff is
        forgotten at this node in every case. ``deadline_s``: the most this waits (default:
        the client's ``timeout_s``), a frozen decode node included. No whole page (the prefill
        was aborted, or nothing of it is of use): nothing is handed off, and the decode node lets
        go of what was pushed to it now (a wait on it answers nothing), not at the ttl."""
        if deadline_s is not None:
            check_deadline(deadline_s, "deadline_s")
        self._pushing_handoffs().pop(handoff_id, None)
        keys = self._page_keys(tokens_or_keys)
        request = handoff_pb2.CompleteHandoffRequest(namespace_id=self.namespace.namespace_id, handoff_id=_id_bytes(handoff_id),
                                                     keys=keys, to_node=to_node or "")
        answer = await self.calls.unary("Handoff.Complete", request, deadline_s)
        return int(answer.num_pages) * self.layout.page_tokens

    async def handoff_wait(self, handoff_id: str, tokens: Any, deadline_s: float) -> Hit:
        """Decode side (a client of the decode node): waits until every page of ``tokens`` is
        held at this node for the handoff (its completion marker), at most ``deadline_s``;
        returns a Hit of the leading pages held here, which the caller reads with ``get`` or
        ``load``. The pages are kept for the caller until it acquires them (get/load) or the
        handoff's ttl passes. num_tokens 0: nothing arrived, the id is unknown or another
        tenant's, or the namespace was invalidated meanwhile; recompute."""
        check_deadline(deadline_s, "deadline_s")
        keys = self._page_keys(tokens)
        if not keys:
            return Hit(self.namespace.namespace_id, 0, [], [])
        request = handoff_pb2.WaitHandoffRequest(namespace_id=self.namespace.namespace_id, handoff_id=_id_bytes(handoff_id),
                                                 keys=keys, deadline_ms=max(1, int(deadline_s * 1000)))
        answer = await self.calls.unary("Handoff.Wait", request, deadline_s + _MARGIN_S)
        n = min(len(keys), int(answer.num_pages))
        runs = [LocationRun(self.node, "host", n, LayoutDesc.of(self.layout).page_bytes)] if n else []
        return Hit(self.namespace.namespace_id, n * self.layout.page_tokens, keys[:n], runs, int(answer.generation))


def _ttl_ms(ttl_s: float) -> int:
    check_deadline(ttl_s, "ttl_s")
    if ttl_s > 600:
        raise InvalidRequest(f"ttl_s must be at most 600 s, got {ttl_s}")
    return max(1, int(ttl_s * 1000))
