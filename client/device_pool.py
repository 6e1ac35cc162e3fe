"""An engine's mapping of its tenant's hbm pool: device memory the server copies the pages an
engine will read on its device into, which the engine then copies device to device.

The server announces the arena socket in GetInfo (``pool_socket``) only to a caller that may
have the pool; the socket hands over the pool of the caller's token's tenant and no other
(kvstore/security/arena_socket.py): a CUDA IPC handle, or, from the CPU implementation of
the device seam the tests run, a shared-memory descriptor. The mapping is made at the
first load that asks for device placement, once; a refusal is logged and the load reads
through the host arena as before.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from kvstore.device_ops import OpenedPool, ops_for_pool
from kvstore.errors import KVStoreError
from kvstore.security.arena_socket import receive_pool

logger = logging.getLogger(__name__)


class PoolMap:
    """This process's mapping of its tenant's pool; ``token`` names it (an Acquire answer's
    device offsets are in the pool whose token it carries)."""

    def __init__(self, opened: OpenedPool, token: bytes, device: str) -> None:
        self._opened = opened
        self.bytes = opened.tensor
        self.token = token
        self.device = device

    def slot(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over one slot of the pool (no copy)."""
        return self.bytes[offset : offset + nbytes]

    def close(self) -> None:
        del self.bytes
        self._opened.close()


class PoolSource:
    """Where this client gets its pool (GetInfo's ``pool_socket``), mapped at first use."""

    def __init__(self, socket_path: str, bearer: str | None) -> None:
        self.socket_path = socket_path
        self.bearer = bearer
        self._pool: PoolMap | None = None
        self._refused = False
        self._lock = threading.Lock()

    def mapping(self) -> PoolMap | None:
        """The pool, mapped now at the first call; None (logged once) when it cannot be."""
        with self._lock:
            if self._pool is None and not self._refused:
                self._pool = self._map()
                self._refused = self._pool is None
            return self._pool

    def answered(self, token: bytes) -> None:
        """An Acquire answer placed pages in the pool ``token`` names: when that is not the
        pool mapped here (the server restarted and made another), the next load maps it
        (the old mapping goes once no load holds a view of it)."""
        with self._lock:
            if token and self._pool is not None and self._pool.token != token:
                logger.info("the server's hbm pool changed (a restart); mapping the new one at the next load")
                self._pool, self._refused = None, False

    def _map(self) -> PoolMap | None:
        try:
            handout, tenant = receive_pool(Path(self.socket_path), self.bearer)
        except KVStoreError as exc:
            logger.info("no hbm pool from %s (%s); device loads read through the arena", self.socket_path, exc)
            return None
        try:
            opened = ops_for_pool(torch.device(handout.device)).open_pool(handout, writable=True)
        except (RuntimeError, OSError) as exc:
            logger.warning("the hbm pool of tenant %s on %s cannot be mapped here (%s); device loads read through the "
                           "arena", tenant, handout.device, exc)
            return None
        finally:
            if handout.fd >= 0:
                os.close(handout.fd)
        logger.info("mapped tenant %s's hbm pool on %s (%d MiB)", tenant, handout.device, handout.size_bytes >> 20)
        return PoolMap(opened, handout.token, handout.device)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
