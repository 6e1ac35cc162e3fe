"""The SSD tier: page slots in one data file, an LMDB index, checksums on every read.

A write is durable before it is indexed, and indexed before anyone can find it:
``pwrite`` header+payload into a free slot -> ``fdatasync`` -> index transaction (synced) ->
the caller publishes. A crash between any two steps leaves either a free slot with stray
bytes (reused later) or an indexed page the directory adopts at start.

O_DIRECT is used where the filesystem allows it (the payload of a page written from the host
arena is already 4 KiB aligned, so it goes to disk without a copy; reads land in aligned
staging buffers and are copied into place while the next page is read); elsewhere I/O is
buffered, which is said once in the log. Each read checks the header and the payload
checksum; a page that fails is quarantined (dropped from the index, listed with its reason).
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lmdb

from kvstore.config import SsdTierConfig
from kvstore.errors import PageCorrupt, TierUnavailable
from kvstore.lmdb_env import map_full, open_env, private_dir
from kvstore.page import HEADER_BYTES, HEADER_CORE_BYTES, PageHeader
from kvstore.pagecopy import copy_checksum_bytes
from kvstore.tiers.base import TierUsage
from kvstore.tiers.device_writes import IndexWrites
from kvstore.tiers.slab import ALIGN, SlabAllocator, round_up
from kvstore.tiers.staging import StagingPool

logger = logging.getLogger(__name__)

_ENTRY = struct.Struct("<QQ")  # offset, slot bytes; followed by the header core
_PAYLOAD = struct.Struct("<Q")
_NS_AT, _KEY_AT, _PAYLOAD_AT = 8, 24, 76  # field offsets in a packed header (see kvstore.page)
DATA_FILE = "pages.dat"
INDEX_DIR = "index.lmdb"


def _place(header: PageHeader, src: memoryview, dst: memoryview) -> bool:
    """Copies a staged page to its destination and verifies it in the same pass; False
    when it fails its checksum."""
    return copy_checksum_bytes(dst, src) == header.checksum


@dataclass(frozen=True)
class Quarantined:
    key: bytes
    namespace_id: bytes
    reason: str
    unix_s: float


def _address(view: memoryview) -> int | None:
    if view.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class SsdTier:
    """Pages on local disk. Metadata calls are serialised by the tier manager; reads and
    writes of distinct slots may run concurrently."""

    name = "ssd"

    def __init__(self, config: SsdTierConfig) -> None:
        self.directory = config.directory
        try:
            private_dir(self.directory)
        except OSError as exc:
            raise TierUnavailable(f"--ssd-dir {self.directory}: {exc.strerror}") from exc
        slab = config.slab_bytes or min(64 << 20, max(16 << 20, config.capacity_bytes // 64))
        slab -= slab % ALIGN  # every slot offset must stay aligned for O_DIRECT
        self.durable = config.sync
        capacity = config.capacity_bytes - config.capacity_bytes % slab
        self.allocator = SlabAllocator(0, capacity, slab)
        self.direct_io = False
        self.fd = self._open_data(self.directory / DATA_FILE, config.direct_io)
        os.fchmod(self.fd, 0o600)  # also when an older version created it world-readable: it holds the KV
        self.env = open_env(self.directory / INDEX_DIR, config.index_map_bytes, max_dbs=4, sync=config.sync)
        self.index_db = self.env.open_db(b"index")
        self.quarantine_db = self.env.open_db(b"quarantine")
        self.index_writes = IndexWrites()  # what index transactions cost the device (the write budget)
        # key -> (offset, header); the header stays raw bytes until first used, so that a
        # restart with a million pages does not parse a million headers.
        self._pages: dict[bytes, tuple[int, PageHeader | bytes]] = {}
        self._local = threading.local()
        self._staging = StagingPool()
        self._load_index()

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

    def _load_index(self) -> None:
        """Rebuilds slot state from the index, dropping entries that cannot be right."""
        size = os.fstat(self.fd).st_size
        dropped: list[tuple[bytes, str]] = []
        candidates: list[tuple[bytes, int, int, PageHeader]] = []
        entry_end = _ENTRY.size + HEADER_CORE_BYTES
        unpack_entry, unpack_payload, add = _ENTRY.unpack_from, _PAYLOAD.unpack_from, candidates.append
        with self.env.begin(db=self.index_db, buffers=False) as txn:
            for key, value in txn.cursor():
                try:
                    offset, slot_bytes = unpack_entry(value)
                    raw = value[_ENTRY.size : entry_end]
                    (payload,) = unpack_payload(raw, _PAYLOAD_AT)
                except struct.error:
                    dropped.append((key, "unreadable index entry"))
                    continue
                if (raw[_KEY_AT : _KEY_AT + 16] != key or slot_bytes != HEADER_BYTES + -(-payload // ALIGN) * ALIGN
                        or offset + slot_bytes > size):
                    dropped.append((key, "index entry does not match the data file"))
                    continue
                add((key, offset, slot_bytes, raw))
        claimed = self.allocator.claim_many([(offset, slot_bytes) for _, offset, slot_bytes, _ in candidates])
        self.recovered: list[tuple[bytes, bytes, int]] = []  # (key, namespace, payload bytes), for the directory
        for (key, offset, _, raw), ok in zip(candidates, claimed):
            if ok:
                self._pages[key] = (offset, raw)
                self.recovered.append((key, raw[_NS_AT : _NS_AT + 16], _PAYLOAD.unpack_from(raw, _PAYLOAD_AT)[0]))
            else:
                dropped.append((key, "index entry overlaps another slot"))
        for key, reason in dropped:
            logger.warning("ssd tier: dropping index entry %s: %s", key.hex(), reason)
        if dropped:
            with self._write_txn(len(dropped), self.index_db) as txn:
                for key, _ in dropped:
                    txn.delete(key)
        logger.info("ssd tier %s: %d pages indexed, %s I/O", self.directory, len(self._pages),
                    "O_DIRECT" if self.direct_io else "buffered")

    @contextmanager
    def _write_txn(self, num_entries: int, db: object) -> Iterator[lmdb.Transaction]:
        """One write transaction of the index: a full map is MetadataFull (nothing written),
        and what it costs the device is charged to the write budget (index_writes)."""
        with map_full(self.env, "the ssd index"), self.index_writes.transaction(num_entries), \
                self.env.begin(write=True, db=db) as txn:
            yield txn

    # -- scratch buffers (aligned, per thread) -------------------------------------------

    def _scratch(self, nbytes: int) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = mmap.mmap(-1, round_up(max(nbytes, 4 << 20)))
            self._local.buf = buf
        return buf

    def _header_buf(self) -> mmap.mmap:
        buf = getattr(self._local, "hdr", None)
        if buf is None:
            buf = self._local.hdr = mmap.mmap(-1, HEADER_BYTES)
        return buf

    def _direct_ok(self, view: memoryview, nbytes: int) -> bool:
        addr = _address(view)
        return addr is not None and addr % ALIGN == 0 and nbytes % ALIGN == 0

    # -- writes --------------------------------------------------------------------------

    @staticmethod
    def slot_bytes(payload_bytes: int) -> int:
        """What writing one page sends to the device: header + payload padded to 4 KiB."""
        return HEADER_BYTES + round_up(payload_bytes)

    def reserve(self, payload_bytes: int) -> int | None:
        return self.allocator.alloc(self.slot_bytes(payload_bytes))

    def unreserve(self, offset: int) -> None:
        self.allocator.free(offset)

    def write_slot(self, offset: int, header: PageHeader, payload: memoryview) -> None:
        """Writes header and payload, zero-padded to whole 4 KiB blocks, into a reserved slot
        (not yet durable nor indexed). The payload's whole blocks go to disk without a copy
        (for O_DIRECT when they are aligned); only the rest is staged."""
        hdr = self._header_buf()
        hdr[:] = header.pack()
        size = header.payload_bytes
        whole = size - size % ALIGN
        if self.direct_io and not self._direct_ok(payload, whole):
            whole = 0
        bufs: list[object] = [hdr, payload[:whole]]
        if whole < size:
            staged = memoryview(self._scratch(size - whole))[: round_up(size - whole)]
            staged[: size - whole] = payload[whole:size]
            staged[size - whole :] = bytes(len(staged) - (size - whole))  # zeros, not an earlier page's bytes
            bufs.append(staged)
        written = os.pwritev(self.fd, bufs, offset)  # type: ignore[arg-type]
        if written != self.slot_bytes(size):
            raise OSError(f"short write to {DATA_FILE}: {written} of {self.slot_bytes(size)} bytes")

    def sync(self) -> None:
        if self.durable:
            os.fdatasync(self.fd)

    def index(self, entries: list[tuple[int, PageHeader]]) -> None:
        """Indexes written slots (after ``sync``); from here they survive a restart. On
        MetadataFull nothing was indexed: the caller frees the slots."""
        with self._write_txn(len(entries), self.index_db) as txn:
            for offset, header in entries:
                value = _ENTRY.pack(offset, self.slot_bytes(header.payload_bytes)) + header.pack()[:HEADER_CORE_BYTES]
                txn.put(header.key, value)
        for offset, header in entries:
            self._pages[header.key] = (offset, header)

    # -- Tier ----------------------------------------------------------------------------

    def _entry(self, key: bytes) -> tuple[int, PageHeader] | None:
        """The entry with its header parsed (and checked) on first use; a header that
        fails its check raises PageCorrupt."""
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

    def namespace_of(self, key: bytes) -> bytes | None:
        entry = self._pages.get(key)
        if entry is None:
            return None
        header = entry[1]
        return header[_NS_AT : _NS_AT + 16] if isinstance(header, bytes) else header.namespace_id

    def payload_bytes_of(self, key: bytes) -> int:
        header = self._pages[key][1]
        return _PAYLOAD.unpack_from(header, _PAYLOAD_AT)[0] if isinstance(header, bytes) else header.payload_bytes

    def header(self, key: bytes) -> PageHeader | None:
        try:
            entry = self._entry(key)
        except PageCorrupt:
            return None
        return entry[1] if entry else None

    def read(self, key: bytes, into: memoryview) -> PageHeader | None:
        """Reads a page into ``into`` (at least the payload, rounded up to 4 KiB when
        aligned for O_DIRECT) and verifies it; raises PageCorrupt. Safe to call without the
        owner's lock while the key cannot be deleted."""
        header = self.read_unverified(key, into)
        if header is not None:
            header.verify_payload(into[: header.payload_bytes], header.payload_bytes)
        return header

    def read_pages(self, items: list[tuple[bytes, memoryview]], helper: Executor) -> tuple[int, str]:
        """Reads pages into their destinations (``(key, into)``, e.g. reserved host slots),
        each verified as it is copied. Returns the index of the first page that is missing,
        unreadable or corrupt (``len(items)`` if none) and why (empty when it was not
        corruption); the destinations before it hold their verified pages.

        The disk reads go back to back into a pair of aligned staging buffers (anonymous
        memory: O_DIRECT into the shared-memory arena reads ~10% slower here) while
        ``helper`` copies each staged page into place and checks it in one pass.
        """
        if not items:
            return 0, ""
        stage = self._staging.take(max(len(into) for _, into in items))
        jobs: list[Future[bool]] = []
        cut, reason = len(items), ""

        def bad(index: int) -> bool:
            if jobs[index].result():
                return False
            nonlocal cut, reason
            cut, reason = min(cut, index), f"page {items[index][0].hex()} failed its checksum"
            return True

        try:
            for index, (key, into) in enumerate(items):
                if index >= 2 and bad(index - 2):  # also frees its staging buffer
                    break
                buf = stage[index % 2]
                try:
                    header = self.read_unverified(key, buf)
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
                jobs.append(helper.submit(_place, header, buf[: header.payload_bytes], into[: header.payload_bytes]))
        finally:
            for job in jobs:  # every copy ends before the buffers go back
                job.exception()
            self._staging.give(stage)
        for index in range(min(cut, len(jobs))):
            if bad(index):
                break
        return cut, reason

    def read_unverified(self, key: bytes, into: memoryview) -> PageHeader | None:
        """``read`` without the payload checksum: the header on disk, the index and the length
        are checked, the payload is in ``into`` but must pass ``header.verify_payload``
        before anyone uses it (so that a caller can hash one page while the next is read)."""
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

    def delete(self, key: bytes) -> bool:
        return self.delete_many([key]) == 1

    def delete_many(self, keys: list[bytes]) -> int:
        """Deletes the stored ones of ``keys`` (a key named twice counts once); returns how many."""
        gone = list(dict.fromkeys(k for k in keys if k in self._pages))
        if not gone:
            return 0
        with self._write_txn(len(gone), self.index_db) as txn:
            for key in gone:
                txn.delete(key)
        for key in gone:
            offset, _ = self._pages.pop(key)
            self.allocator.free(offset)
        return len(gone)

    def usage(self) -> TierUsage:
        return TierUsage(len(self._pages), self.allocator.used_bytes, self.allocator.capacity)

    # -- quarantine ----------------------------------------------------------------------

    def quarantine(self, key: bytes, reason: str) -> None:
        namespace_id = self.namespace_of(key) or b""
        logger.error("ssd tier: quarantining page %s: %s", key.hex(), reason)
        record = json.dumps({"namespace_id": namespace_id.hex(), "reason": reason, "unix_s": time.time()})
        with self._write_txn(1, self.quarantine_db) as txn:
            txn.put(key, record.encode())
        self.delete(key)

    def quarantined(self) -> list[Quarantined]:
        out = []
        with self.env.begin(db=self.quarantine_db) as txn:
            for key, value in txn.cursor():
                rec = json.loads(bytes(value))
                out.append(Quarantined(bytes(key), bytes.fromhex(rec["namespace_id"]), rec["reason"], rec["unix_s"]))
        return out

    def purge_quarantine(self) -> int:
        with self._write_txn(1, self.quarantine_db) as txn:
            n = txn.stat(self.quarantine_db)["entries"]
            txn.drop(self.quarantine_db, delete=False)
        return n

    def close(self) -> None:
        self.env.close()
        os.close(self.fd)
