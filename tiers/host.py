"""The host tier: one shared-memory arena of page slots in /dev/shm.

More: tiers/README.md (### host.py).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Sequence
from pathlib import Path

from kvstore.config import HostTierConfig
from kvstore.errors import ConfigError, PageCorrupt
from kvstore.page import ARENA_MAGIC, PageHeader
from kvstore.tiers.base import (
    UNOWNED,
    ArenaInfo,
    NoEvents,
    Quarantined,
    ReadResult,
    StoredPage,
    StoreEvents,
    TierUsage,
    parent_links,
)
from kvstore.tiers.indexed import IndexedPages
from kvstore.tiers.slab import ALIGN, SlabAllocator

logger = logging.getLogger(__name__)

ARENA_HEADER_BYTES = ALIGN


def _owned(fd: int) -> bool:
    """Whether a live server holds the arena open: its owner keeps an exclusive lock on it
    for its whole life, which the kernel drops when the owner dies however it dies (a pid
    may outlive its process as a zombie or be reused, so ``kill(pid, 0)`` cannot tell)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


def remove_stale_arenas(shm_dir: Path, node: str) -> None:
    """Unlinks arenas left by servers of this node that died without cleaning up."""
    for path in shm_dir.glob(f"kvstore-{node}-*"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO of that name must not block the start
        except OSError:  # gone meanwhile, or another user's: not ours to judge
            continue
        try:
            # An empty file is being created: its owner takes the lock before it sizes it. Only a
            # regular file is an arena (a directory of that name, e.g. a data dir, is not ours).
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_size > 0 and not _owned(fd):
                logger.info("removing stale arena %s", path)
                path.unlink(missing_ok=True)
        finally:
            os.close(fd)


def _check_memory(arena_bytes: int, lower: str) -> None:
    """Refuses an anonymous arena the host's available memory cannot hold (it is reserved up
    front: past that, the OOM killer would pick a victim)."""
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    free = int(fields["MemAvailable"].split()[0]) * 1024
    if arena_bytes > free:
        raise ConfigError(f"a {arena_bytes >> 20} MiB arena does not fit in the {free >> 20} MiB of memory available "
                          f"(lower {lower})")


def _check_room(shm_dir: Path, arena_bytes: int) -> None:
    """Refuses an arena its filesystem cannot hold before touching it (filling /dev/shm
    would starve every process of the host)."""
    fs = os.statvfs(shm_dir)
    free = fs.f_bavail * fs.f_frsize
    if arena_bytes > free:
        raise ConfigError(f"--host-capacity: a {arena_bytes >> 20} MiB arena does not fit in {shm_dir} "
                          f"({free >> 20} MiB free of {fs.f_blocks * fs.f_frsize >> 20} MiB)")


class HostTier(IndexedPages):
    """Pages in a shared-memory arena, indexed by key (a ``LandingTier``). ``lower``: what to lower
    when an anonymous arena does not fit in the memory available (its refusal says so)."""

    name = "host"

    def __init__(self, config: HostTierConfig, node: str = "local", *, base: int = 0, anonymous: bool = False,
                 owner: str = UNOWNED, events: StoreEvents | None = None, lower: str = "--host-capacity") -> None:
        self.config = config
        self.owner = owner
        self._events = events or NoEvents()  # the core's eviction order of this arena
        self._base = base
        token = secrets.token_bytes(16)
        capacity = config.capacity_bytes - config.capacity_bytes % config.slab_bytes
        arena_bytes = ARENA_HEADER_BYTES + capacity
        if anonymous:
            self.path: Path | None = None
            _check_memory(arena_bytes, lower)
            fd = os.memfd_create(f"kvstore-{node}-arena", os.MFD_CLOEXEC)
            os.fchmod(fd, 0o600)  # a memfd is created 0777; /proc/<pid>/fd/ is the one way to reach it by name
        else:
            remove_stale_arenas(config.shm_dir, node)
            self.path = config.shm_dir / f"kvstore-{node}-{os.getpid()}-{token.hex()[:8]}"
            _check_room(config.shm_dir, arena_bytes)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held until close (or death): the arena is in use
            os.ftruncate(fd, arena_bytes)
            try:  # reserve every page now: a sparse arena runs out mid-write later, and that is SIGBUS
                os.posix_fallocate(fd, 0, arena_bytes)
            except OSError as exc:
                raise ConfigError(f"--host-capacity: no room for a {arena_bytes >> 20} MiB arena in {config.shm_dir} "
                                  f"({exc.strerror})") from None
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(fd, arena_bytes, flags=flags)
        except BaseException:
            os.close(fd)
            if self.path is not None:
                self.path.unlink(missing_ok=True)
            raise
        self._lock_fd = fd
        self.arena = ArenaInfo(str(self.path or ""), arena_bytes, token, fd)
        self._buffer = memoryview(self._mmap)
        self._buffer[: len(ARENA_MAGIC) + 16] = ARENA_MAGIC + token
        self._allocator = SlabAllocator(base + ARENA_HEADER_BYTES, capacity, config.slab_bytes)
        self._pages: dict[bytes, tuple[int, PageHeader]] = {}
        self._quarantine: list[Quarantined] = []
        self._lock = threading.Lock()
        logger.info("host arena %s: %d MiB in %d slabs", self.path or "(anonymous)", capacity >> 20, self._allocator.num_slabs)

    # -- slots ---------------------------------------------------------------------------

    def reserve(self, payload_bytes: int) -> int | None:
        """A free slot's offset, or None when the arena is full (the caller evicts)."""
        with self._lock:
            return self._allocator.alloc(payload_bytes)

    def unreserve(self, slot: int) -> None:
        with self._lock:
            self._allocator.free(slot)

    def write(self, pages: list[tuple[int, PageHeader, memoryview]]) -> None:
        for slot, header, payload in pages:
            self.view(slot, header.payload_bytes)[:] = payload[: header.payload_bytes]

    def commit(self, pages: list[tuple[int, PageHeader]], parents: Sequence[bytes | None] = ()) -> None:
        """Makes reserved, written slots the stored copies of their keys (``parents``: see
        Tier.commit)."""
        links = parent_links(parents, len(pages))
        with self._lock:
            for (slot, header), parent in zip(pages, links):
                old = self._pages.get(header.key)
                if old is not None and old[0] != slot:
                    self._allocator.free(old[0])
                self._pages[header.key] = (slot, header)
                self._events.stored(header.key, parent)

    def view(self, slot: int, nbytes: int) -> memoryview:
        start = slot - self._base
        return self._buffer[start : start + nbytes]

    def offset(self, slot: int) -> int:
        return slot - self._base

    def memory(self) -> memoryview:
        """The whole arena as this process maps it (pinned.py page-locks it)."""
        return self._buffer

    def slot_bytes(self, slot: int) -> int:
        with self._lock:
            return self._allocator.slot_bytes(slot)

    def fits(self, page_bytes: int) -> bool:
        return self._allocator.fits(page_bytes)

    # -- reads ---------------------------------------------------------------------------

    def read_into(self, pages: list[tuple[bytes, memoryview]], verify: bool = True) -> ReadResult:
        """Copies and verifies each page, whatever ``verify`` says (shared memory another
        process may write: the copy is not worth having unchecked)."""
        for index, (key, into) in enumerate(pages):
            entry = self._pages.get(key)
            if entry is None:
                return ReadResult(index)
            slot, header = entry
            into[: header.payload_bytes] = self.view(slot, header.payload_bytes)
            try:
                header.verify_payload(into[: header.payload_bytes], header.payload_bytes)
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
        return []  # a new arena: what the last process held in RAM is gone

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(len(self._pages), self._allocator.used_bytes, self._allocator.capacity)

    def close(self) -> None:
        self._buffer.release()
        try:
            self._mmap.close()
        except BufferError:
            logger.warning("host arena still has exported views at close; leaving the mapping")
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        os.close(self._lock_fd)
