"""A client's mapping of the server's shared-memory arena.

Without tenants the server announces its arena's path; with tenants it announces a Unix
socket that hands this client its tenant's arena as a file descriptor for its bearer token
(kvstore/security/arena_socket.py). Either way the arena is mapped only when it is there and
starts with the token the server announced over gRPC, i.e. client and server share a host
(and it is that server's). Otherwise pages go over gRPC.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from kvstore.device_ops import DeviceOps, ops_for
from kvstore.errors import KVStoreError
from kvstore.page import ARENA_MAGIC as _MAGIC
from kvstore.security.arena_socket import receive_arena

logger = logging.getLogger(__name__)



class ArenaMap:
    def __init__(self, mm: mmap.mmap, writable: bool = True, token: bytes = b"") -> None:
        self._mmap = mm
        self.token = token  # the server's arena token: an Allocate or Acquire answer names the arena its offsets are in
        self.writable = writable  # False: a read-only token's mapping (PROT_READ); writing into it would fault
        with warnings.catch_warnings():  # torch warns that it cannot mark a tensor read-only; numpy's array is
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(mm, dtype=torch.uint8)
        self.array = np.frombuffer(mm, dtype=np.uint8)  # numpy slicing costs ~1 us, torch's ~10
        self.size_bytes = len(mm)
        # With CUDA, page-locked: slot <-> GPU copies (layer-wise loads and saves) are then DMA.
        self._uses = 0  # copies, layer-wise loads and saves reading or writing it now (hold / drop)
        self._retired = False  # a restarted server's arena replaced it: closed once the last use ends
        self._closed = False
        self._use_lock = threading.Lock()
        self._ops: DeviceOps | None = ops_for(torch.device("cuda")) if torch.cuda.is_available() else None
        self._pinned_at = self._pin(self._ops) if self._ops is not None else None

    def _pin(self, ops: DeviceOps) -> int | None:
        """CUDA ONLY. Pins this process's mapping; its address, or None when refused."""
        address = int(self.array.ctypes.data)
        return address if ops.pin_host(address, len(self.array), read_only=not self.writable) else None

    @classmethod
    def open(cls, path: str, size: int, token: bytes) -> ArenaMap | None:
        """The mapping, or None (with the reason logged) when this host cannot map it."""
        if not path:
            return None
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            logger.info("arena %s not reachable (%s); pages go over gRPC", path, exc.strerror)
            return None
        return cls._map(fd, path, size, token)

    @classmethod
    def receive(cls, socket_path: str, bearer: str | None, size: int, token: bytes) -> ArenaMap | None:
        """The mapping of this caller's tenant's arena, handed over by the server's arena
        socket for ``bearer`` (the client's token), or None (reason logged): another host,
        another uid, no token, or a refusal."""
        if not socket_path or bearer is None:
            return None
        try:
            fd, _, tenant = receive_arena(Path(socket_path), bearer)
        except KVStoreError as exc:
            logger.info("no arena from %s (%s); pages go over gRPC", socket_path, exc)
            return None
        return cls._map(fd, f"of tenant {tenant}", size, token)

    @classmethod
    def _map(cls, fd: int, name: str, size: int, token: bytes) -> ArenaMap | None:
        """Maps ``fd`` (closed here) if it is the arena announced: ``size`` bytes starting with ``token``."""
        try:
            if os.fstat(fd).st_size != size:
                logger.info("arena %s has another size than announced; pages go over gRPC", name)
                return None
            # A read-only token's descriptor (arena_socket.py) is mapped read-only: it can be no other way.
            writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
            # MAP_POPULATE maps the (already resident) arena up front: a first touch per 4 KiB
            # page would otherwise cost a fault on the hot path.
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        finally:
            os.close(fd)
        if mm[: len(_MAGIC) + len(token)] != _MAGIC + token:
            logger.info("arena %s belongs to another server; pages go over gRPC", name)
            mm.close()
            return None
        return cls(mm, writable, bytes(token))

    def slot(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over one slot (no copy)."""
        return self.bytes[offset : offset + nbytes]

    def hold(self) -> bool:
        """One more user of the mapping (its slot views stay valid until its ``drop``); False
        when it is closed already. The views do not keep an mmap open (torch.frombuffer takes no
        buffer export): a mapping closed under a held view would be read or written unmapped."""
        with self._use_lock:
            if self._closed:
                return False
            self._uses += 1
            return True

    def drop(self) -> None:
        """A user is done; a retired mapping closes with its last user."""
        with self._use_lock:
            self._uses -= 1
            last = self._retired and self._uses == 0 and not self._closed
            self._closed = self._closed or last  # under the lock: a ``hold`` from here on is refused
        if last:
            self._unmap()

    def retire(self) -> None:
        """Closes the mapping once nobody holds it (now, when nobody does)."""
        with self._use_lock:
            self._retired = True
            idle = self._uses == 0 and not self._closed
            self._closed = self._closed or idle
        if idle:
            self._unmap()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._use_lock:
            if self._closed:
                return
            self._closed = True
        self._unmap()

    def _unmap(self) -> None:
        """Once marked closed (under the lock, where ``hold`` looks): nobody holds it or is granted it."""
        if self._ops is not None and self._pinned_at is not None:  # CUDA ONLY: before the mapping goes
            self._ops.unpin_host(self._pinned_at)
            self._pinned_at = None
        del self.bytes
        del self.array
        try:
            self._mmap.close()
        except BufferError:
            logger.debug("arena mapping still referenced; left to the garbage collector")
