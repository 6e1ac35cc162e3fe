"""The hbm tier: a pool of page slots in GPU memory, above the host tier.

More: tiers/README.md (### hbm.py).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Sequence

import torch

from kvstore.config import HbmTierConfig
from kvstore.device_ops import DeviceOps, PoolHandout, ops_for_pool
from kvstore.errors import PageCorrupt, TierUnavailable
from kvstore.page import PageHeader
from kvstore.tiers.base import UNOWNED, NoEvents, Quarantined, ReadResult, StoredPage, StoreEvents, TierUsage, parent_links
from kvstore.tiers.indexed import IndexedPages
from kvstore.tiers.slab import SlabAllocator

logger = logging.getLogger(__name__)


def check_device(config: HbmTierConfig) -> torch.device:
    """The device the pool goes on; TierUnavailable when it cannot be used here."""
    device = torch.device(config.device)
    if device.type == "cpu":
        logger.warning("hbm tier emulated in host memory (--hbm-device cpu): for tests only")
        return device
    if not torch.cuda.is_available():
        raise TierUnavailable("--tiers hbm needs a CUDA device and none is visible; drop hbm from --tiers "
                              "(--hbm-device cpu emulates it in host memory, for tests only)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise TierUnavailable(f"--hbm-device {config.device}: only {torch.cuda.device_count()} CUDA devices are visible")
    return torch.device("cuda", index)


def _host_bytes(buffer: memoryview, nbytes: int) -> torch.Tensor:
    """``buffer[:nbytes]`` as a uint8 tensor sharing its memory (a read-only buffer, which
    torch cannot wrap without a warning, is copied: only tests pass one)."""
    if buffer.readonly:
        return torch.frombuffer(bytearray(buffer[:nbytes]), dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)


class HbmTier(IndexedPages):
    """Pages in one device-memory pool, indexed by key (a ``Tier``)."""

    name = "hbm"

    def __init__(self, config: HbmTierConfig, ops: DeviceOps | None = None, base: int = 0, owner: str = UNOWNED,
                 events: StoreEvents | None = None) -> None:
        """``ops``: the device seam (default: that of ``config.device``); ``base``: the number
        of the first slot (several pools behind one tier never share a slot number); ``owner``:
        the owner whose pool it is; ``events``: the core's eviction order of the pool."""
        self.config = config
        self.owner = owner
        self._events = events or NoEvents()
        self.device = check_device(config)
        self.ops = ops or ops_for_pool(self.device)
        self._base = base
        capacity = config.capacity_bytes - config.capacity_bytes % config.slab_bytes
        # One allocation for the tier's life: slots never go back to the allocator, so a
        # handed-out pool names the same memory as long as the tier lives.
        self._device_pool = self.ops.new_pool(capacity, secrets.token_bytes(16))
        self.pool = self._device_pool.tensor
        self._allocator = SlabAllocator(base, capacity, config.slab_bytes)
        self._pages: dict[bytes, tuple[int, PageHeader]] = {}
        self._quarantine: list[Quarantined] = []
        self._lock = threading.Lock()
        logger.info("hbm pool on %s: %d MiB in %d slabs", self.ops.name, capacity >> 20, self._allocator.num_slabs)

    # -- slots ---------------------------------------------------------------------------

    def reserve(self, payload_bytes: int) -> int | None:
        with self._lock:
            return self._allocator.alloc(payload_bytes) if self._allocator.fits(payload_bytes) else None

    def unreserve(self, slot: int) -> None:
        with self._lock:
            self._allocator.free(slot)

    def write(self, pages: list[tuple[int, PageHeader, memoryview]]) -> None:
        """Copies each payload from host memory into its slot (host -> device; a pinned
        source makes it DMA). Returns once the bytes are in the pool."""
        for slot, header, payload in pages:
            nbytes = header.payload_bytes
            self.device_view(slot, nbytes).copy_(_host_bytes(payload, nbytes))

    def commit(self, pages: list[tuple[int, PageHeader]], parents: Sequence[bytes | None] = ()) -> None:
        with self._lock:
            for (slot, header), parent in zip(pages, parent_links(parents, len(pages)), strict=True):
                old = self._pages.get(header.key)
                if old is not None and old[0] != slot:
                    self._allocator.free(old[0])
                self._pages[header.key] = (slot, header)
                self._events.stored(header.key, parent)

    def fits(self, page_bytes: int) -> bool:
        """Whether a page of ``page_bytes`` fits one slot at all."""
        return self._allocator.fits(page_bytes)

    def device_view(self, slot: int, nbytes: int) -> torch.Tensor:
        """The slot's bytes in the pool (on the device): for copies that stay on it."""
        start = slot - self._base
        return self.pool[start : start + nbytes]

    def offset(self, slot: int) -> int:
        """The byte offset of ``slot`` in the pool, as an engine that maps it addresses it."""
        return slot - self._base

    @property
    def handout(self) -> PoolHandout:
        """What the arena socket hands the pool's owner (tiers/pools.py)."""
        return self._device_pool.handout

    # -- reads ---------------------------------------------------------------------------

    def read_into(self, pages: list[tuple[bytes, memoryview]], verify: bool = True) -> ReadResult:
        """Copies pages out of the pool (device -> host) and verifies each there, whatever
        ``verify`` says (the check is what makes the copy worth trusting)."""
        for index, (key, into) in enumerate(pages):
            entry = self._pages.get(key)
            if entry is None:
                return ReadResult(index)
            slot, header = entry
            nbytes = header.payload_bytes
            torch.frombuffer(into, dtype=torch.uint8, count=nbytes).copy_(self.device_view(slot, nbytes))
            try:
                header.verify_payload(into[:nbytes], nbytes)
            except PageCorrupt as exc:
                return ReadResult(index, str(exc))
        return ReadResult(len(pages))

    # -- removal -------------------------------------------------------------------------

    def delete(self, keys: list[bytes], evicted: bool = False) -> int:
        count = 0
        with self._lock:
            for key in keys:
                entry = self._pages.pop(key, None)
                if entry is not None:
                    self._allocator.free(entry[0])
                    self._events.removed(key, evicted)
                    count += 1
        return count

    def detach(self, key: bytes) -> int | None:
        """Drops ``key`` from the index, its slot kept reserved (returned; None: not held): an
        engine a lease handed its offset still reads it there. The caller unreserves it later."""
        with self._lock:
            entry = self._pages.pop(key, None)
            if entry is None:
                return None
            self._events.removed(key, False)
            return entry[0]

    def stored_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._pages)

    # -- index ---------------------------------------------------------------------------

    def recover(self) -> list[StoredPage]:
        return []  # device memory: what the last process held is gone

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(len(self._pages), self._allocator.used_bytes, self._allocator.capacity)

    def close(self) -> None:
        with self._lock:
            self._pages.clear()
        self.pool = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._device_pool.tensor = self.pool
        self._device_pool.release()  # the pool goes back to the device
