"""Layer-wise load and save: copies run on their own worker while the engine computes.

A ``LayerLoad`` fetches a hit into the engine's KV layer by layer. Before the first layer
is released every page is leased and checked against its checksum, so the valid prefix
(``num_tokens``) is fixed before compute can use any of it: a missing or corrupt page only
shortens it (partial recompute), never leaves garbage marked valid. Every ``wait`` is
bounded by a deadline; past it the load is abandoned (no further byte is written into the
engine's KV) and ``wait`` returns False: recompute.

On CPU the worker is a thread. (On CUDA the copy into device memory would run on a side
stream with one event per layer; that path needs a GPU and is not built yet.)

Life of a load::

    started --leases+checks--> verified --layer i copied--> ... --> done
        \\______________ deadline / error: abandoned (num_tokens = 0) ______/

Background I/O uses the client's synchronous channel, so it progresses even while the
engine's compute blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from kvstore.client.engine_kv import EngineKV
from kvstore.client.pages import slot_as_page
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.page import checksum

if TYPE_CHECKING:
    from kvstore.client.client import Hit, KVStoreClient

logger = logging.getLogger(__name__)


class LayerLoad:
    """Handle of a layer-wise load; see the module docstring."""

    def __init__(self, client: KVStoreClient, hit: Hit, into: EngineKV, ahead: int, deadline_s: float) -> None:
        layout = client.layout
        if into.num_tokens < hit.num_tokens:
            raise InvalidRequest(f"into holds {into.num_tokens} tokens, the hit has {hit.num_tokens}")
        self.client = client
        self.hit = hit
        self.into = into
        self.num_layers = layout.num_layers
        self.ahead = max(0, min(ahead, layout.num_layers))
        self.deadline = time.monotonic() + deadline_s
        self.num_tokens = hit.num_tokens
        self.error: BaseException | None = None
        self._layer_ready = [threading.Event() for _ in range(layout.num_layers)]
        self._done = threading.Event()
        self._abandoned = False
        self._copy_lock = threading.Lock()
        self._first_wait = True
        self._thread = threading.Thread(target=self._run, name="kv-layer-load", daemon=True)
        self._thread.start()

    # -- engine side ---------------------------------------------------------------------

    def wait(self, layer: int) -> bool:
        """Blocks until ``layer`` of every valid page is in place (the first call waits for
        the first ``ahead`` layers too). False: give up and recompute (``num_tokens`` is 0)."""
        target = max(layer, self.ahead - 1) if self._first_wait else layer
        self._first_wait = False
        if self._abandoned:
            return False
        ok = self._layer_ready[target].wait(max(0.0, self.deadline - time.monotonic()))
        if not ok or self.error is not None:
            self.abandon("deadline passed" if not ok else f"load failed: {self.error}")
            return False
        return True

    def abandon(self, reason: str) -> None:
        """Stops the load; after this returns no byte is written into the engine's KV."""
        with self._copy_lock:
            if not self._abandoned and not self._done.is_set():
                self._abandoned = True
                self.num_tokens = 0
                logger.warning("layer-wise load of %d tokens abandoned: %s", self.hit.num_tokens, reason)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    async def finished(self) -> int:
        """Waits (bounded by the deadline) for the worker; returns tokens actually loaded."""
        remaining = max(0.0, self.deadline - time.monotonic())
        done = await asyncio.get_running_loop().run_in_executor(None, self._done.wait, remaining)
        if not done:
            self.abandon("deadline passed")
        return self.num_tokens

    # -- worker --------------------------------------------------------------------------

    def _run(self) -> None:
        leases: list[int] = []
        try:
            sources = self._fetch(leases)
            valid = self._verify(sources)
            with self._copy_lock:
                if not self._abandoned:
                    self.num_tokens = valid * self.client.layout.page_tokens
            start = time.perf_counter()
            for layer in range(self.num_layers):
                for page in range(valid):
                    with self._copy_lock:
                        if self._abandoned:
                            return
                        self.into.write_layer(page, layer, self._layer_view(sources[page], layer))
                self._layer_ready[layer].set()
            self.client.record_load(valid * self.client.layout.page_bytes, time.perf_counter() - start)
        except BaseException as exc:  # noqa: BLE001 - reported to the engine through wait()
            self.error = exc
            logger.warning("layer-wise load failed: %s", exc)
            for event in self._layer_ready:
                event.set()
        finally:
            for lease_id in leases:
                self.client.release_sync(lease_id)
            self._done.set()

    def _fetch(self, leases: list[int]) -> list[Any]:
        """Leases the pages (arena) or streams them (no arena); returns one source per page
        of the longest prefix that could be had."""
        client = self.client
        if client.arena is None:
            staging = client.read_pages_sync(self.hit.keys)
            return staging
        sources: list[Any] = []
        keys = self.hit.keys
        while len(sources) < len(keys) and not self._abandoned:
            batch = keys[len(sources) : len(sources) + client.max_pages]
            acq = client.acquire_sync(batch)
            leases.append(acq.lease_id)
            if not acq.pages:
                break
            sources.extend(acq.pages)
        return sources

    def _verify(self, sources: list[Any]) -> int:
        client = self.client
        if client.arena is None:
            return len(sources)  # checked on arrival
        n = client.layout.page_bytes
        for i, page in enumerate(sources):
            if checksum(client.arena.array[page.offset : page.offset + n]) != page.checksum:
                logger.error("page %d of a hit failed its checksum; loading the %d pages before it", i, i)
                return i
        return len(sources)

    def _layer_view(self, source: Any, layer: int) -> torch.Tensor:
        layout = self.client.layout
        if isinstance(source, torch.Tensor):
            page = source
        else:
            page = self.client.arena.slot(source.offset, layout.page_bytes)  # type: ignore[union-attr]
        return slot_as_page(page, layout)[layer]


class LayerSave:
    """Handle of a layer-wise save: ``layer_done(i)`` copies layer i of the new full pages
    out behind compute; pages are committed (published) only when all layers are stored."""

    def __init__(self, client: KVStoreClient, tokens: Any, kv: EngineKV, start: int, durable: bool) -> None:
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
        self.durable = durable
        self._layers: queue.Queue[int | None] = queue.Queue()
        self._marked: set[int] = set()
        self._result: int | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-layer-save", daemon=True)
        self._thread.start()

    def abandon(self, reason: str) -> None:
        """Stops a save that will not be finished (the client is closing): every layer is
        released so the worker copies and commits, or fails, promptly."""
        if not self._done.is_set():
            logger.info("layer-wise save closing: %s", reason)
            for layer in range(self.client.layout.num_layers):
                self.layer_done(layer)

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
        for layer in range(self.client.layout.num_layers):
            self.layer_done(layer)
        timeout = timeout_s if timeout_s is not None else self.client.timeout_s
        done = await asyncio.get_running_loop().run_in_executor(None, self._done.wait, timeout)
        if not done:
            raise KVStoreError(f"layer-wise save did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        assert self._result is not None
        return self._result

    def _run(self) -> None:
        client, layout = self.client, self.client.layout
        alloc = None
        try:
            if not self.keys:
                self._result = self.first_page * layout.page_tokens
                return
            if client.arena is not None:
                alloc = client.allocate_sync(self.keys)
                todo = [(i, slot) for i, slot in enumerate(alloc.slots) if not slot.exists]
                targets = [client.arena.slot(slot.offset, layout.page_bytes) for _, slot in todo]
            else:
                todo = [(i, None) for i in range(len(self.keys))]
                targets = [torch.empty(layout.page_bytes, dtype=torch.uint8) for _ in todo]
            pages = [slot_as_page(target, layout) for target in targets]
            for _ in range(layout.num_layers):
                layer = self._layers.get()
                assert layer is not None
                for (i, _), page in zip(todo, pages):
                    page[layer].copy_(self.kv.read_layer(self.first_page + i, layer))
            sums = [checksum(t.numpy()) for t in targets]
            if alloc is not None:
                asked = len(alloc.slots)
                published = client.commit_sync(alloc.allocation_id, [slot.key for _, slot in todo], sums, self.durable)
                alloc = None
            else:
                asked = len(todo)
                published = client.write_pages_sync([self.keys[i] for i, _ in todo], targets, sums, self.durable)
            stored = client.published_prefix(asked, published, self.durable, self.first_page)
            self._result = (self.first_page + stored) * layout.page_tokens
        except BaseException as exc:  # noqa: BLE001 - raised again by finished()
            self.error = exc if isinstance(exc, KVStoreError) else KVStoreError(f"layer-wise save failed: {exc!r}")
            if alloc is not None:
                client.abort_sync(alloc.allocation_id)
        finally:
            self._done.set()

