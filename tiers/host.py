"""The host tier: one shared-memory arena of page slots in /dev/shm.

The server creates and owns the arena; same-host clients map the same file and copy page
bytes in and out directly, so no page byte crosses a socket. The first 4 KiB hold a magic
and a random token: a client that reads the token the server announced is on this host.
The server holds an exclusive ``flock`` on the arena file while it lives; a server starting on
the same node removes the arenas no one holds (their owner died, even by SIGKILL).
Slots are 4 KiB aligned (slab.py). Who may write a slot is decided by the tier manager
(allocations and leases); this class only keeps the arena and the stored-page index.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
from pathlib import Path

from kvstore.config import HostTierConfig
from kvstore.errors import PageCorrupt
from kvstore.page import PageHeader
from kvstore.tiers.base import TierUsage
from kvstore.tiers.slab import ALIGN, SlabAllocator

logger = logging.getLogger(__name__)

ARENA_MAGIC = b"KVARENA1"
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
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone meanwhile, or another user's: not ours to judge
            continue
        try:
            # An empty file is being created: its owner takes the lock before it sizes it.
            if not _owned(fd) and os.fstat(fd).st_size > 0:
                logger.info("removing stale arena %s", path)
                path.unlink(missing_ok=True)
        finally:
            os.close(fd)


class HostTier:
    """Pages in a shared-memory arena, indexed by key."""

    name = "host"

    def __init__(self, config: HostTierConfig, node: str = "local") -> None:
        remove_stale_arenas(config.shm_dir, node)
        self.token = secrets.token_bytes(16)
        self.path = config.shm_dir / f"kvstore-{node}-{os.getpid()}-{self.token.hex()[:8]}"
        capacity = config.capacity_bytes - config.capacity_bytes % config.slab_bytes
        self.arena_bytes = ARENA_HEADER_BYTES + capacity
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held until close (or death): the arena is in use
            os.ftruncate(fd, self.arena_bytes)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(fd, self.arena_bytes, flags=flags)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        self._lock_fd = fd
        self.buffer = memoryview(self._mmap)
        self.buffer[: len(ARENA_MAGIC) + 16] = ARENA_MAGIC + self.token
        self.allocator = SlabAllocator(ARENA_HEADER_BYTES, capacity, config.slab_bytes)
        self._pages: dict[bytes, tuple[int, PageHeader]] = {}
        logger.info("host arena %s: %d MiB in %d slabs", self.path, capacity >> 20, self.allocator.num_slabs)

    # -- slots ---------------------------------------------------------------------------

    def reserve(self, page_bytes: int) -> int | None:
        """A free slot's offset, or None when the arena is full (the caller evicts)."""
        return self.allocator.alloc(page_bytes)

    def unreserve(self, offset: int) -> None:
        self.allocator.free(offset)

    def install(self, header: PageHeader, offset: int) -> None:
        """Makes a reserved, written slot the stored copy of ``header.key``."""
        self._pages[header.key] = (offset, header)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self.buffer[offset : offset + nbytes]

    def slot(self, key: bytes) -> tuple[int, PageHeader] | None:
        return self._pages.get(key)

    # -- Tier ----------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return key in self._pages

    def header(self, key: bytes) -> PageHeader | None:
        entry = self._pages.get(key)
        return entry[1] if entry else None

    def verify(self, key: bytes) -> None:
        """Raises PageCorrupt (and drops the page) if its slot no longer matches its checksum."""
        offset, header = self._pages[key]
        try:
            header.verify_payload(self.view(offset, header.payload_bytes), header.payload_bytes)
        except PageCorrupt:
            self.delete(key)
            raise

    def delete(self, key: bytes) -> bool:
        entry = self._pages.pop(key, None)
        if entry is None:
            return False
        self.allocator.free(entry[0])
        return True

    def usage(self) -> TierUsage:
        return TierUsage(len(self._pages), self.allocator.used_bytes, self.allocator.capacity)

    def close(self) -> None:
        self.buffer.release()
        try:
            self._mmap.close()
        except BufferError:
            logger.warning("host arena still has exported views at close; leaving the mapping")
        self.path.unlink(missing_ok=True)
        os.close(self._lock_fd)
