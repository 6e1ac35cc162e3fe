"""Layer-wise save: each layer the engine finished is copied out behind compute; the pages
are published only when all their layers are stored.

More: client/layerwise/README.md (### save.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvstore.client.engine_kv import EngineKV
from kvstore.client.hit import published_prefix
from kvstore.client.staging import staging_page
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.pagecopy import running_checksum, scatter_checksum
from kvstore.types import KVLayout

if TYPE_CHECKING:
    from kvstore.client.client import KVStoreClient
    from kvstore.client.transport.contract import Outgoing

logger = logging.getLogger(__name__)


class LayerSave:
    """Handle of a layer-wise save; see the module docstring."""

    def __init__(self, client: KVStoreClient, tokens: Any, kv: EngineKV, start: int, durable: bool,
                 session_id: str = "", generation: int | None = None) -> None:
        layout = client.layout
        if start % layout.page_tokens:
            raise InvalidRequest(f"save start {start} must be page-aligned ({layout.page_tokens} tokens)")
        keys = client.keys(tokens)
        if kv.num_tokens < len(keys) * layout.page_tokens:
            raise InvalidRequest(f"kv holds {kv.num_tokens} tokens, {len(keys) * layout.page_tokens} are needed")
        self.client = client
        self.kv = kv
        self.first_page = start // layout.page_tokens
        self.keys = keys[self.first_page :]
        self.parent = keys[self.first_page - 1] if self.first_page else b""  # the server evicts the tail of a prefix first
        self.durable = durable
        self.session_id = session_id  # the session saved (its fence refuses the save at the server)
        self.generation = generation  # the one the KV was computed in (the server refuses it once invalidated)
        self._layers: queue.Queue[int | None] = queue.Queue()
        self._marked: set[int] = set()
        self._result: int | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-layer-save", daemon=True)
        self._thread.start()

    def abandon(self, reason: str) -> None:
        """Stops a save that will not be finished (the client is closing). Layers the engine
        did not mark done are never copied: unless every layer was marked, nothing is
        published and the reservation is given back."""
        if not self._done.is_set():
            logger.info("layer-wise save closing: %s", reason)
            self._layers.put(None)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def layer_done(self, layer: int) -> None:
        if not 0 <= layer < self.client.layout.num_layers:
            raise InvalidRequest(f"layer {layer} out of range")
        if layer not in self._marked:
            self._marked.add(layer)
            self._layers.put(layer)

    async def finished(self, timeout_s: float | None = None) -> int:
        """Marks any layer not yet done, waits for the commit; returns the number of leading
        tokens now stored. Raises the worker's error."""
        self.mark_all()
        timeout = timeout_s if timeout_s is not None else self.client.timeout_s
        done = await asyncio.get_running_loop().run_in_executor(None, self._done.wait, timeout)
        if not done:
            raise KVStoreError(f"layer-wise save did not finish within {timeout} s")
        return self.result()

    def mark_all(self) -> None:
        """Marks every layer not yet done, without waiting (a synchronous engine hook then
        polls ``wait(0)``)."""
        for layer in range(self.client.layout.num_layers):
            self.layer_done(layer)

    def wait(self, timeout_s: float) -> bool:
        """True once the save ended (published, failed or abandoned), waiting at most
        ``timeout_s``; ``result()`` then answers at once."""
        return self._done.wait(timeout_s)

    def result(self) -> int:
        """The leading tokens stored by a save that ended; raises its error."""
        if not self._done.is_set():
            raise KVStoreError("the layer-wise save has not ended yet")
        if self.error is not None:
            raise self.error
        assert self._result is not None
        return self._result

    def _next_layer(self, outgoing: Outgoing, renewed: float) -> tuple[int | None, float]:
        """The next layer the engine marked done (None: abandoned). Meanwhile the reserved
        slots are renewed every third of their term, so that an engine slower than one term
        never has its layers copied into slots the server gave to another writer (a renewal
        refused raises: nothing more is copied)."""
        runtime, timeout = self.client.runtime, self.client.timeout_s
        while True:
            term = outgoing.term_s
            if math.isinf(term):
                return self._layers.get(), renewed
            left = renewed + term / 3 - time.monotonic()
            try:
                if left > 0:
                    return self._layers.get(timeout=left), renewed
            except queue.Empty:
                pass
            runtime.run(outgoing.renew(timeout), timeout)
            renewed = time.monotonic()

    def _run(self) -> None:
        client, layout, runtime = self.client, self.client.layout, self.client.runtime
        outgoing = client.transport.outgoing(self.session_id, self.generation)
        try:
            if not self.keys:
                self._result = self.first_page * layout.page_tokens
                return
            runtime.run(outgoing.reserve(self.keys, self.parent), client.timeout_s)
            renewed = time.monotonic()
            pages = LayerCopies(self.kv, layout, self.first_page, outgoing.indices, outgoing.buffers)
            said = 0  # leading layers said to the server
            ahead = len(outgoing.indices) * layout.page_bytes >= client.push_layers_min_bytes
            for _ in range(layout.num_layers):
                layer, renewed = self._next_layer(outgoing, renewed)
                if layer is None:
                    raise KVStoreError("layer-wise save abandoned before the engine marked every layer done; nothing was stored")
                pages.copy(layer)
                if ahead and said < pages.hashed < layout.num_layers and client.pushes(self.keys):
                    said = pages.hashed  # not waited for: the next layer's copy goes on (a renewal the commit overtakes is moot)
                    runtime.submit(_say_written(outgoing, said, client.timeout_s))
            sums = pages.checksums()
            published = runtime.run(outgoing.publish(sums, self.durable), client.timeout_s)
            stored = published_prefix(outgoing.asked, published, self.durable, self.first_page, layout.page_tokens)
            self._result = (self.first_page + stored) * layout.page_tokens
        except BaseException as exc:  # noqa: BLE001 - raised again by finished()
            self.error = exc if isinstance(exc, KVStoreError) else KVStoreError(f"layer-wise save failed: {exc!r}")
        finally:
            try:
                runtime.run(outgoing.discard(), client.timeout_s)
            except KVStoreError as exc:
                logger.warning("a layer-wise save could not give back its reservation (it expires): %s", exc)
            self._done.set()


async def _say_written(outgoing: Outgoing, layers: int, timeout_s: float) -> None:
    """``outgoing.written``, whose failure costs only the push of those layers (the pages still
    go once stored): a save whose commit came first, a node that did not answer."""
    try:
        await outgoing.written(layers, timeout_s)
    except KVStoreError as exc:
        logger.debug("layers written not said to the server: %s", exc)


class LayerCopies:
    """Copies the engine's layers into the save's page buffers and computes each page's checksum
    from the bytes as they are copied, never by reading a buffer back: an arena slot is shared
    memory (a stale allocation's writer, another writer of the tenant), and hashing the slot after
    writing it would commit another writer's bytes with their own checksum. A page is layer-major,
    so its checksum is fed layer after layer: a layer gathered into a private buffer is copied into
    the slot and hashed in one pass (``scatter_checksum``); one the engine marked done before an
    earlier layer is copied in and kept privately until its turn to be hashed."""

    def __init__(self, kv: EngineKV, layout: KVLayout, first_page: int, indices: list[int], buffers: list[torch.Tensor]) -> None:
        self.kv, self.layout, self.first_page, self.indices = kv, layout, first_page, indices
        self.slots = [buffer.numpy() for buffer in buffers]  # 1-D uint8, page_bytes each
        self.layer_bytes = layout.page_bytes // layout.num_layers
        self.sums = [running_checksum() for _ in buffers]
        self.hashed = 0  # layers fed to every page's checksum so far
        self.early: dict[int, list[np.ndarray]] = {}  # layers copied ahead of their turn: private copies

    def _gathered(self, page: int, layer: int, into: torch.Tensor) -> np.ndarray:
        """Layer ``layer`` of engine page ``page`` as contiguous private bytes (in ``into``)."""
        shape = self.layout.page_shape()[1:]
        into.view(self.layout.torch_dtype()).view(shape).copy_(self.kv.read_layer(page, layer))  # blocking
        return into.numpy()

    def copy(self, layer: int) -> None:
        at, n = layer * self.layer_bytes, self.layer_bytes
        if layer != self.hashed:  # ahead of its turn: stored now, hashed from the private copy later
            kept = [self._gathered(self.first_page + i, layer, torch.empty(n, dtype=torch.uint8)) for i in self.indices]
            for slot, private in zip(self.slots, kept):
                np.copyto(slot[at : at + n], private)
            self.early[layer] = kept
            return
        staging = staging_page(n, False)
        for i, slot, running in zip(self.indices, self.slots, self.sums):
            private = self._gathered(self.first_page + i, layer, staging)
            scatter_checksum([running], slot, [at], [], [n], [private])  # stored and hashed in one pass
        self.hashed += 1
        while self.hashed in self.early:
            for running, private in zip(self.sums, self.early.pop(self.hashed)):
                running.update(private)
            self.hashed += 1

    def checksums(self) -> list[int]:
        assert self.hashed == self.layout.num_layers, "every layer is copied before the pages are published"
        return [int(running.intdigest()) for running in self.sums]
