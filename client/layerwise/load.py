"""Layer-wise load: copies run on their own worker while the engine computes.

More: client/layerwise/README.md (### load.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import xxhash

from kvstore.client.engine_kv import ContiguousKV, EngineKV
from kvstore.client.hostpages import HostPages
from kvstore.client.layerwise.device import kv_device, layer_signals
from kvstore.client.pages import as_bytes, page_rows, slot_as_page
from kvstore.device_ops import DeviceOps, ops_for
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.page import checksummer
from kvstore.pagecopy import running_checksum

if TYPE_CHECKING:
    from kvstore.client.client import KVStoreClient
    from kvstore.client.hit import Hit

logger = logging.getLogger(__name__)

DEFAULT_LEASE_MS = 30_000  # the server's default, for a client that leaves lease_ms at 0


class LayerLoad:
    """Handle of a layer-wise load; see the module docstring."""

    def __init__(self, client: KVStoreClient, hit: Hit, into: EngineKV, ahead: int, deadline_s: float,
                 ops: DeviceOps | None = None) -> None:
        """``ops``: the device seam of ``into`` (None: read off its tensors, ``ops_for``)."""
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
        self.ops = ops if ops is not None else ops_for(kv_device(into))  # None: KV in host memory
        self._staged = client.transport.staged(on_device=self.ops is not None)
        self._signals = layer_signals(self.ops, layout.num_layers)  # host thread, or side stream + events
        self._keeper = threading.Thread(target=self._keep, name="kv-lease-keeper", daemon=True)
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
        ok = ready and not self._abandoned and not self._cut
        if ok:
            self._signals.engine_waits(target)
        return ok

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

    @property
    def pages_received(self) -> int:
        """Pages the transport has received so far (not all verified): how far a load cut
        short got, and so at what pace it ran."""
        return len(self._staged.pages)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._keeper.is_alive():  # it stops once the worker is done
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
        runtime = self.client.runtime
        staged = self._staged
        try:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise KVStoreError("deadline passed before the pages were read")
            self._keeper.start()
            # fill stops at the deadline by itself (a stream cut by it ends short); the bound
            # of run() is a backstop for an RPC that hangs
            runtime.run(staged.fill(self.hit.keys, remaining), remaining + self.client.timeout_s)
            host_pages = getattr(self.into, "host_pages", None) if self.ops is None else None
            host: HostPages | None = host_pages() if host_pages is not None and staged.pages else None
            valid = len(staged.pages) if host is not None else staged.verify()  # fused: checked as copied
            with self._copy_lock:
                if self._final:
                    return
                self.num_tokens = valid * self.client.layout.page_tokens
            start = time.perf_counter()
            with self._signals.copying():  # host thread, or the side stream (device.py)
                good = self._copy_fused(host, valid) if host is not None else self._copy_checked(valid)
            if good is None:
                return
            if good < valid:
                staged.failed_at(good)  # named at release: the server checks it (placement/reported.py)
            self._finish(valid, good)
            self.client.record_load(good * self.client.layout.page_bytes, time.perf_counter() - start)
        except BaseException as exc:  # noqa: BLE001 - reported to the engine through wait()
            self.error = exc
            self.abandon(f"load failed: {exc}")
        finally:
            try:
                self._signals.drain()  # no copy out of the slots may outlive their leases
            except Exception:  # a device error: the load already failed or is cut; leases still go back
                logger.exception("layer-wise load: waiting for the side stream failed")
            try:
                runtime.run(staged.release(), self.client.timeout_s)
            except KVStoreError as exc:
                logger.warning("a layer-wise load could not give back its pages (they expire): %s", exc)
            self._done.set()

    def _copy_fused(self, host: HostPages, valid: int) -> int | None:
        """Layer after layer, one native call copies the layer of every page and feeds each
        page's running checksum; returns the leading pages whose bytes held their checksum
        (None: the load ended meanwhile)."""
        staged, layout = self._staged, self.client.layout
        step = layout.page_bytes // layout.num_layers
        sources = [as_bytes(page).numpy() for page in staged.pages[:valid]]
        sums = [running_checksum() for _ in range(valid)]
        pages = range(valid)
        for layer in range(self.num_layers):
            parts = [source[layer * step : (layer + 1) * step] for source in sources]
            if not self._write(lambda: host.write_layer(layer, pages, parts, sums)):  # noqa: B023 - called at once
                return None
            self._signals.issued(layer)
            if layer < self.num_layers - 1:
                self._layer_ready[layer].set()
        return next((i for i in range(valid) if sums[i].intdigest() != staged.checksums[i]), valid)

    def _copy_checked(self, valid: int) -> int | None:
        """Page by page and layer by layer through ``EngineKV.write_layer``, hashing what
        landed; returns the leading pages whose copies held their checksum (None: the load
        ended meanwhile)."""
        staged, layout = self._staged, self.client.layout
        landed = [checksummer() for _ in range(valid)]
        for layer in range(self.num_layers):
            for page in range(valid):
                source = slot_as_page(staged.pages[page], layout)[layer]
                if not self._write(lambda: self.into.write_layer(page, layer, source)):  # noqa: B023 - called at once
                    return None
                self._hash_landed(landed[page], page, layer)
            self._signals.issued(layer)
            if layer < self.num_layers - 1:
                self._layer_ready[layer].set()
        return next((i for i in range(valid) if landed[i].intdigest() != staged.checksums[i]), valid)

    def _write(self, write: Callable[[], None]) -> bool:
        """Runs one write into the engine's KV unless the load is over (False). A write is
        started only if, at the pace of the slowest one so far, it ends before the
        deadline: the engine's KV is its own again at the deadline."""
        with self._copy_lock:
            if self._final:
                return False
            start = time.monotonic()
            if start + self._slowest_write_s >= self.deadline:
                self._abandon_locked("deadline reached")
                return False
            write()
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

    def _keep(self) -> None:
        """Renews what the load holds every third of the lease ttl until the worker is done;
        a renewal refused means slots may have been reused: the load is abandoned."""
        ttl_s = (self.client.lease_ms or DEFAULT_LEASE_MS) / 1000
        while not self._done.wait(ttl_s / 3):
            if self._final:
                return
            try:
                self.client.runtime.run(self._staged.renew(ttl_s), ttl_s)
            except KVStoreError as exc:
                self.abandon(f"a lease was lost: {exc}")
                return
