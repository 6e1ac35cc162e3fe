"""The SSD tier: page slots in one data file, an LMDB index, checksums on every read.

A write is durable before it is indexed, and indexed before anyone can find it:
``write`` (pwrite header+payload into a reserved slot) -> ``commit`` (fdatasync, then the
synced index transaction) -> the caller publishes. A crash between any two steps leaves
either a free slot with stray bytes (reused later) or an indexed page the directory adopts
at start (``recover``).

More: tiers/README.md (### ssd.py); DESIGN §4.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from kvstore.config import SsdTierConfig, format_size
from kvstore.errors import ConfigError, PageCorrupt, TierUnavailable
from kvstore.lmdb_env import private_dir
from kvstore.page import (
    HEADER_BYTES,
    HEADER_CORE_BYTES,
    NAMESPACE_AT,
    PAYLOAD_BYTES_AT,
    PAYLOAD_BYTES_FIELD,
    PageHeader,
    peek,
    peek_generation,
)
from kvstore.pagecopy import copy_checksum_bytes
from kvstore.tiers.base import NoEvents, Quarantined, ReadResult, StoredPage, StoreEvents, TierUsage, parent_links
from kvstore.tiers.slab import ALIGN, SlabAllocator, round_up
from kvstore.tiers.ssd_index import SsdIndex, slot_bytes
from kvstore.tiers.ssd_slabs import keep_slab_bytes, stored_slab_bytes
from kvstore.tiers.ssd_staging import StagingPool
from kvstore.tiers.ssd_writes import DATA_FILE, SsdWrites

logger = logging.getLogger(__name__)

INDEX_DIR = "index.lmdb"


def _place(header: PageHeader, src: memoryview, dst: memoryview) -> bool:
    """Copies a staged page to its destination and verifies it in the same pass; False
    when it fails its checksum."""
    return copy_checksum_bytes(dst, src) == header.checksum


class SsdTier(SsdWrites):
    """Pages on local disk (a ``Tier``; its writes: ssd_writes.py)."""

    name = "ssd"
    slot_bytes = staticmethod(slot_bytes)

    def __init__(self, config: SsdTierConfig, events: StoreEvents | None = None) -> None:
        self.directory = config.directory
        self._events = events or NoEvents()  # the core's eviction order of the tier
        try:
            private_dir(self.directory)
        except OSError as exc:
            raise TierUnavailable(f"--ssd-dir {self.directory}: {exc.strerror}") from exc
        self.durable = config.sync
        self.direct_io = False
        self.fd = self._open_data(self.directory / DATA_FILE, config.direct_io)
        os.fchmod(self.fd, 0o600)  # also when an older version created it world-readable: it holds the KV
        self._index = SsdIndex(self.directory / INDEX_DIR, config.index_map_bytes, config.sync)
        self.index_writes = self._index.writes  # what index transactions cost the device (the write budget)
        slab = self._slab_bytes(config)
        self._allocator = SlabAllocator(0, config.capacity_bytes - config.capacity_bytes % slab, slab)
        # key -> (offset, header); the header stays raw bytes until first used, so that a
        # restart with a million pages does not parse a million headers.
        self._pages: dict[bytes, tuple[int, PageHeader | bytes]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._staging = StagingPool()
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-ssd-verify")  # checks beside reads
        self._recovered: list[StoredPage] = []
        try:
            self._load_index(config.capacity_bytes)
        except BaseException:
            self.close()
            raise

    # -- start-up ------------------------------------------------------------------------

    def _open_data(self, path: Path, want_direct: bool) -> int:
        flags = os.O_RDWR | os.O_CREAT
        if want_direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
                probe = mmap.mmap(-1, ALIGN)
                os.pread(fd, 0, 0)
                os.preadv(fd, [probe], 0)
                self.direct_io = True
                return fd
            except OSError as exc:
                logger.warning("ssd tier: O_DIRECT not available on %s (%s); using buffered I/O", path.parent, exc.strerror)
        return os.open(path, flags, 0o600)

    def _slab_bytes(self, config: SsdTierConfig) -> int:
        """The slab size the stored pages were placed with, else one derived from the
        capacity (and kept, ssd_slabs.py): slabs of another size would not line up with their slots."""
        derived = config.slab_bytes or min(64 << 20, max(16 << 20, config.capacity_bytes // 64))
        derived -= derived % ALIGN  # every slot offset must stay aligned for O_DIRECT
        stored = stored_slab_bytes(self.directory)
        if stored is None:
            keep_slab_bytes(self.directory, derived)
            return derived
        if stored != derived:
            logger.info("ssd tier %s: %s slabs, as its pages were placed (this capacity alone would give %s)",
                        self.directory, format_size(stored), format_size(derived))
        return stored

    def _load_index(self, capacity_bytes: int) -> None:
        """Rebuilds slot state from the index, dropping entries that cannot be right; a
        capacity too small for the stored pages is refused, not a reason to drop them."""
        entries, links = self._index.load(os.fstat(self.fd).st_size)
        end = max((offset + size for _, offset, size, _ in entries), default=0)
        slab = self._allocator.slab_bytes
        if end > self._allocator.capacity or self._allocator.capacity == 0:
            raise ConfigError(f"--ssd-capacity {format_size(capacity_bytes)} is less than the pages stored in {self.directory} "
                              f"take: give at least {format_size(max(end + (-end) % slab, slab))}, or an empty --ssd-dir")
        # Where entries conflict (a damaged offset naming another page's slot, or a slot of a slab
        # of another size), the slots' headers on disk tell which entries are right.
        claimed = self._allocator.claim_many([(offset, size) for _, offset, size, _ in entries],
                                             lambda i: self._holds(entries[i][1], entries[i][3]))
        overlapping = []
        recovered, payload_of = self._recovered, PAYLOAD_BYTES_FIELD.unpack_from
        parents, stored = dict(links), self._events.stored
        for (key, offset, _, raw), ok in zip(entries, claimed):
            if ok:
                self._pages[key] = (offset, raw)
                stored(key, parents.get(key))
                recovered.append((key, raw[NAMESPACE_AT : NAMESPACE_AT + 16], payload_of(raw, PAYLOAD_BYTES_AT)[0],
                                  peek_generation(raw)))
            else:
                overlapping.append((key, "index entry overlaps another slot, or names none"))
        self._index.drop(overlapping)
        logger.info("ssd tier %s: %d pages indexed, %s I/O", self.directory, len(self._pages),
                    "O_DIRECT" if self.direct_io else "buffered")

    def _holds(self, offset: int, raw: bytes) -> bool:
        """Whether the slot at ``offset`` starts with the header an index entry copied (``raw``,
        which names its key). Read at start only for entries that conflict."""
        hdr = self._header_buf()
        try:
            got = os.preadv(self.fd, [hdr], offset)
        except OSError as exc:
            logger.error("ssd tier: reading the slot header at %d failed: %s", offset, exc)
            return False
        return got == HEADER_BYTES and hdr[: len(raw)] == raw

    def recover(self) -> list[StoredPage]:
        """What the index held when the tier was opened (handed over once)."""
        recovered, self._recovered = self._recovered, []
        return recovered

    # -- writes --------------------------------------------------------------------------

    def reserve(self, payload_bytes: int) -> int | None:
        with self._lock:
            return self._allocator.alloc(slot_bytes(payload_bytes))

    def unreserve(self, slot: int) -> None:
        with self._lock:
            self._allocator.free(slot)

    def commit(self, pages: list[tuple[int, PageHeader]], parents: Sequence[bytes | None] = ()) -> None:
        """Syncs the written slots, then indexes them (synced), with their ``parents`` (see
        Tier.commit): from here they survive a restart. On MetadataFull or an I/O error
        nothing was indexed."""
        if not pages:
            return
        links = parent_links(parents, len(pages))
        if self.durable:
            os.fdatasync(self.fd)
        self._index.put(pages, links)
        with self._lock:
            for (slot, header), parent in zip(pages, links):
                old = self._pages.pop(header.key, None)
                if old is not None and old[0] != slot:
                    self._allocator.free(old[0])
                self._pages[header.key] = (slot, header)
                self._events.stored(header.key, parent)

    # -- reads ---------------------------------------------------------------------------

    def _entry(self, key: bytes) -> tuple[int, PageHeader] | None:
        """The entry with its header parsed (and checked) on first use; a header that
        fails its check raises PageCorrupt."""
        with self._lock:
            entry = self._pages.get(key)
            if entry is None:
                return None
            offset, header = entry
            if isinstance(header, bytes):
                header = PageHeader.unpack(header)
                self._pages[key] = (offset, header)
            return offset, header

    def contains(self, key: bytes) -> bool:
        return key in self._pages

    def find(self, key: bytes) -> tuple[int, PageHeader] | None:
        try:
            return self._entry(key)
        except PageCorrupt:
            return None  # a damaged index entry: ``contains`` still says it is held, and a read reports it

    def read_into(self, pages: list[tuple[bytes, memoryview]], verify: bool = True) -> ReadResult:
        """Reads pages into their destinations, each verified as it is copied.

        The disk reads go back to back into a pair of aligned staging buffers (anonymous
        memory: O_DIRECT into the shared-memory arena reads ~10% slower here) while a
        helper thread copies each staged page into place and checks it in one pass.
        ``verify`` False: each page is read straight into place (O_DIRECT where it is
        aligned) and only its header and length are checked; whoever consumes the bytes
        checks the payload (DESIGN §4, one hash where the bytes are consumed).
        """
        if not pages:
            return ReadResult(0)
        if not verify:
            return self._read_in_place(pages)
        stage = self._staging.take(max(len(into) for _, into in pages))
        jobs: list[Future[bool]] = []
        cut, reason = len(pages), ""

        def bad(index: int) -> bool:
            if jobs[index].result():
                return False
            nonlocal cut, reason
            cut, reason = min(cut, index), f"page {pages[index][0].hex()} failed its checksum"
            return True

        try:
            for index, (key, into) in enumerate(pages):
                if index >= 2 and bad(index - 2):  # also frees its staging buffer
                    break
                buf = stage[index % 2]
                try:
                    header = self._read_unverified(key, buf)
                except PageCorrupt as exc:
                    cut, reason = index, str(exc)
                    break
                except OSError as exc:
                    logger.error("ssd tier: read of %s failed: %s", key.hex(), exc)
                    cut = index
                    break
                if header is None:
                    cut = index
                    break
                jobs.append(self._verifier.submit(_place, header, buf[: header.payload_bytes], into[: header.payload_bytes]))
        finally:
            for job in jobs:  # every copy ends before the buffers go back
                job.exception()
            self._staging.give(stage)
        for index in range(min(cut, len(jobs))):
            if bad(index):
                break
        return ReadResult(cut, reason)

    def _read_in_place(self, pages: list[tuple[bytes, memoryview]]) -> ReadResult:
        for index, (key, into) in enumerate(pages):
            try:
                if self._read_unverified(key, into) is None:
                    return ReadResult(index)
            except PageCorrupt as exc:
                return ReadResult(index, str(exc))
            except OSError as exc:
                logger.error("ssd tier: read of %s failed: %s", key.hex(), exc)
                return ReadResult(index)
        return ReadResult(len(pages))

    def _read_unverified(self, key: bytes, into: memoryview) -> PageHeader | None:
        """A page's bytes into ``into``, its header, the index and the length checked but
        not the payload checksum (the caller checks it while the next page is read)."""
        entry = self._entry(key)
        if entry is None:
            return None
        offset, header = entry
        padded = round_up(header.payload_bytes)
        hdr = self._header_buf()
        if len(into) >= padded and self._direct_ok(into, padded):
            got = os.preadv(self.fd, [hdr, into[:padded]], offset)
            payload = into[: header.payload_bytes]
        else:
            scratch = self._scratch(padded)
            got = os.preadv(self.fd, [hdr, memoryview(scratch)[:padded]], offset)
            payload = memoryview(scratch)[: header.payload_bytes]
        if got < HEADER_BYTES + header.payload_bytes:
            raise PageCorrupt(f"page {key.hex()} is truncated on disk ({got} bytes read)")
        on_disk = PageHeader.unpack(hdr[:HEADER_CORE_BYTES])
        if on_disk != header:
            raise PageCorrupt(f"page {key.hex()} header on disk does not match the index")
        if payload.obj is not into.obj:
            into[: header.payload_bytes] = payload
        return header

    # -- removal -------------------------------------------------------------------------

    def delete(self, keys: list[bytes], evicted: bool = False) -> int:
        """Deletes the stored ones of ``keys`` (a key named twice counts once); returns how many."""
        gone = list(dict.fromkeys(k for k in keys if k in self._pages))
        if not gone:
            return 0
        self._index.delete(gone)
        count = 0
        with self._lock:
            for key in gone:
                entry = self._pages.pop(key, None)
                if entry is not None:
                    self._allocator.free(entry[0])
                    self._events.removed(key, evicted)
                    count += 1
        return count

    def quarantine(self, key: bytes, reason: str) -> None:
        entry = self._pages.get(key)
        if entry is None:
            return
        header = entry[1]
        namespace_id = peek(header)[0] if isinstance(header, bytes) else header.namespace_id
        logger.error("ssd tier: quarantining page %s: %s", key.hex(), reason)
        self._index.quarantine(key, namespace_id, reason)
        with self._lock:
            entry = self._pages.pop(key, None)
            if entry is not None:
                self._allocator.free(entry[0])
                self._events.removed(key, False)

    def quarantined(self, purge: bool = False) -> list[Quarantined]:
        return self._index.quarantined(purge)

    def stored_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._pages)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(len(self._pages), self._allocator.used_bytes, self._allocator.capacity)

    def close(self) -> None:
        self._verifier.shutdown(wait=True)
        self._index.close()
        os.close(self.fd)
