"""One server per directory: an exclusive lock on the data and SSD directories.

Two servers on the same files would each place pages in slots of ``pages.dat`` it
believes free and write the same LMDB maps, so a second one must refuse to start. The lock
is an ``flock`` on a ``kvstore.lock`` file in each directory, held for the server's life: the
kernel drops it when the holder dies, however it dies, so a crashed server never blocks its
successor (a pid file alone cannot tell a dead owner from a reused pid).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.lmdb_env import FILE_MODE, private_dir

logger = logging.getLogger(__name__)

LOCK_NAME = "kvstore.lock"


class DirectoryLock:
    """Holds the lock of each directory in ``directories`` (created 0700 if missing) until
    ``release()``; raises ConfigError, holding none, when a live server holds one."""

    def __init__(self, directories: Iterable[tuple[Path, str]]) -> None:
        self._fds: list[int] = []
        taken: set[Path] = set()
        try:
            for directory, flag in directories:
                if directory.resolve() not in taken:  # --ssd-dir may be the --data-dir itself
                    self._fds.append(self._take(directory, flag))
                    taken.add(directory.resolve())
        except BaseException:
            self.release()
            raise

    @staticmethod
    def _take(directory: Path, flag: str) -> int:
        private_dir(directory)
        path = directory / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"{flag} {directory} is in use by another kvstore-server (pid {holder}): "
                              f"give each server its own {flag}") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message above; the lock is what counts
        return fd

    def release(self) -> None:
        while self._fds:
            os.close(self._fds.pop())  # closing drops the flock
