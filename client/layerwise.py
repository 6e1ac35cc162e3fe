"""Layer-wise load and save: copies run on their own worker while the engine computes.

A ``LayerLoad`` fetches a hit into the engine's KV layer by layer. Its contract:

* Before the first layer is released every page is leased and checked against its
  checksum: ``num_tokens`` is then the prefix the engine may compute on (whole pages). A
  missing or corrupt page only shortens it (partial recompute); it never grows.
* ``wait(layer)`` True: layer ``layer`` of those ``num_tokens`` tokens is in place. What
  landed in the engine's KV is verified page by page against the page checksum once the
  page's last layer is in, so the final word is ``wait(num_layers - 1)``. If a page fails
  there (its slot changed under the load), that wait returns False and ``num_tokens`` drops
  to the verified pages before it: the engine must recompute from ``num_tokens`` on,
  including what it computed on top of the dropped pages, since layers it was already
  given may have held wrong KV for them. A page that failed is never counted.
* The deadline is known at start and the worker watches it itself: it starts a layer
  write only if, at the pace of the slowest so far, it ends before the deadline. At the
  deadline, on ``abandon`` (the client closing), on an error or on a lost lease, the load
  is abandoned: no layer write starts any more (once ``abandon`` or a False ``wait``
  returned, none is in progress), ``wait`` returns False and ``num_tokens`` is 0:
  recompute everything.
* ``finished()`` returns the tokens delivered and verified: 0 when abandoned.
* Leases (arena path) are renewed every third of their ttl for the life of the load, from
  a thread of their own (the worker may be inside the engine's write); a renewal refused
  (the lease expired: its slots may have been reused) abandons the load.

On CPU the worker is a thread. (On CUDA the copy into device memory would run on a side
stream with one event per layer; that path needs a GPU and is not built yet.)

Life of a load::

    started --leased+checked--> copying --last layer in, every page verified--> done
       |                           |------last layer in, page i failed its check--> done (num_tokens: i pages)
       '---------------------------'--deadline / abandon / error / lease lost--> abandoned (num_tokens = 0)

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
import xxhash

from kvstore.client.engine_kv import ContiguousKV, EngineKV
from kvstore.client.pages import as_bytes, page_rows, slot_as_page
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.page import checksum, checksummer

if TYPE_CHECKING:
    from kvstore.client.client import Hit, KVStoreClient

logger = logging.getLogger(__name__)

DEFAULT_LEASE_MS = 30_000  # the server's default, for a client that leaves lease_ms at 0


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
        self._done = threading.Event()  # the worker returned and gave its leases back
        self._copy_lock = threading.Lock()  # held around every write into the engine's KV
        self._final = False  # num_tokens is the result (done or abandoned); set under _copy_lock
        self._abandoned = False
        self._cut = False  # a page failed its check after copying
        self._slowest_write_s = 0.0
        self._rows = page_rows(into.kv, layout) if isinstance(into, ContiguousKV) else None
        self._leases: list[bytes] = []
        self._keeper: threading.Thread | None = None
        self._first_wait = True
        self._thread = threading.Thread(target=self._run, name="kv-layer-load", daemon=True)
        self._thread.start()

    # -- engine side ---------------------------------------------------------------------

    def wait(self, layer: int) -> bool:
        """Blocks until ``layer`` of every valid page is in place (the first call waits for
        the first ``ahead`` layers too). False: recompute from ``num_tokens`` (0 when the
        load was abandoned)."""
        if not 0 <= layer < self.num_layers:
            raise InvalidRequest(f"layer {layer} out of range")
        target = max(layer, self.ahead - 1) if self._first_wait else layer
        self._first_wait = False
        ready = self._layer_ready[target].wait(max(0.0, self.deadline - time.monotonic()))
        if not ready:
            self.abandon("deadline passed")
        return ready and not self._abandoned and not self._cut

    def abandon(self, reason: str) -> None:
        """Stops the load; after this returns no byte is written into the engine's KV."""
        with self._copy_lock:
            self._abandon_locked(reason)

    def _abandon_locked(self, reason: str) -> None:
        if self._final:
            return
        self._final = self._abandoned = True
        self.num_tokens = 0
        logger.warning("layer-wise load of %d tokens abandoned: %s", self.hit.num_tokens, reason)
        for event in self._layer_ready:
            event.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._keeper is not None:  # it stops once the worker is done
            self._keeper.join(timeout_s)

    async def finished(self) -> int:
        """Waits (bounded by the deadline) for the worker; returns the tokens delivered and
        verified (0 when the load was abandoned or failed)."""
        remaining = max(0.0, self.deadline - time.monotonic())
        done = await asyncio.get_running_loop().run_in_executor(None, self._done.wait, remaining)
        if not done:
            self.abandon("deadline passed")
        return self.num_tokens

    # -- worker --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            sources, sums = self._fetch()
            valid = self._verify(sources, sums)
            with self._copy_lock:
                if self._final:
                    return
                self.num_tokens = valid * self.client.layout.page_tokens
            landed = [checksummer() for _ in range(valid)]
            start = time.perf_counter()
            for layer in range(self.num_layers):
                for page in range(valid):
                    if not self._write(page, layer, sources[page]):
                        return
                    self._hash_landed(landed[page], page, layer)
                if layer < self.num_layers - 1:
                    self._layer_ready[layer].set()
            good = next((i for i in range(valid) if landed[i].intdigest() != sums[i]), valid)
            self._finish(valid, good)
            self.client.record_load(good * self.client.layout.page_bytes, time.perf_counter() - start)
        except BaseException as exc:  # noqa: BLE001 - reported to the engine through wait()
            self.error = exc
            self.abandon(f"load failed: {exc}")
        finally:
            for lease_id in self._leases:
                self.client.release_sync(lease_id)
            self._done.set()

    def _fetch(self) -> tuple[list[Any], list[int]]:
        """Leases the pages (arena) or streams them (no arena); returns one source and its
        checksum per page of the longest prefix that could be had."""
        client = self.client
        if client.arena is None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise KVStoreError("deadline passed before the pages were read")
            staging = client.read_pages_sync(self.hit.keys, remaining)  # a stream cut by the deadline ends short
            return staging, [checksum(page.numpy()) for page in staging]
        sources: list[Any] = []
        keys = self.hit.keys
        while len(sources) < len(keys) and not self._final:
            if time.monotonic() >= self.deadline:
                raise KVStoreError("deadline passed while the pages were leased")
            batch = keys[len(sources) : len(sources) + client.max_pages]
            acq = client.acquire_sync(batch)
            self._leases.append(acq.lease_id)
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._keep_leases, name="kv-lease-keeper", daemon=True)
                self._keeper.start()
            if not acq.pages:
                break
            sources.extend(acq.pages)
        return sources, [page.checksum for page in sources]

    def _verify(self, sources: list[Any], sums: list[int]) -> int:
        """Pages of the prefix whose source still holds its checksum (the streamed ones were
        checked on arrival)."""
        client = self.client
        if client.arena is None:
            return len(sources)
        n = client.layout.page_bytes
        for i, page in enumerate(sources):
            if checksum(client.arena.array[page.offset : page.offset + n]) != sums[i]:
                logger.error("page %d of a hit failed its checksum; loading the %d pages before it", i, i)
                return i
        return len(sources)

    def _write(self, page: int, layer: int, source: Any) -> bool:
        """Writes one layer of one page into the engine's KV unless the load is over (False).
        A write is started only if, at the pace of the slowest one so far, it ends before
        the deadline: the engine's KV is its own again at the deadline."""
        with self._copy_lock:
            if self._final:
                return False
            start = time.monotonic()
            if start + self._slowest_write_s >= self.deadline:
                self._abandon_locked("deadline reached")
                return False
            self.into.write_layer(page, layer, self._layer_view(source, layer))
            self._slowest_write_s = max(self._slowest_write_s, time.monotonic() - start)
            return True

    def _hash_landed(self, landed: xxhash.xxh3_64, page: int, layer: int) -> None:
        """Feeds what is now in the engine's KV for (page, layer) to the page's running
        checksum, in the page's byte order (layer-major, K then V)."""
        rows = self._rows
        if rows is not None:  # a CPU tensor: numpy views of its rows, no copy
            first = layer * self.client.layout.kv_factor
            for row in rows.rows[first : first + self.client.layout.kv_factor]:
                landed.update(row[page * rows.run : (page + 1) * rows.run])
            return
        for part in self.into.read_layer(page, layer):
            landed.update(as_bytes(part.contiguous()).cpu().numpy())

    def _finish(self, valid: int, good: int) -> None:
        with self._copy_lock:
            if self._final:
                return
            self._final = True
            if good < valid:
                self._cut = True
                logger.error("page %d of a layer-wise load changed under the load (its copy failed the checksum); "
                             "%d tokens are valid, recompute the rest", good, good * self.client.layout.page_tokens)
            self.num_tokens = good * self.client.layout.page_tokens
        self._layer_ready[-1].set()

    def _keep_leases(self) -> None:
        """Renews the leases every third of their ttl until the result is final; a renewal
        refused means their slots may have been reused: the load is abandoned."""
        ttl_s = (self.client.lease_ms or DEFAULT_LEASE_MS) / 1000
        while not self._done.wait(ttl_s / 3):
            for lease_id in list(self._leases):
                if self._final:
                    return
                try:
                    self.client.renew_sync(lease_id, ttl_s)
                except KVStoreError as exc:
                    self.abandon(f"lease {lease_id.hex()[:8]} lost: {exc}")
                    return

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
        """Stops a save that will not be finished (the client is closing). Layers the engine
        did not mark done are never copied: unless every layer was marked, nothing is
        published and the allocation is given back."""
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
                if layer is None:
                    raise KVStoreError("layer-wise save abandoned before the engine marked every layer done; nothing was stored")
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

