"""A node's last registration epoch, kept in its own data directory (issue 34, defect 8).

etcd keeps each node's epoch too, but an etcd that was wiped or restored from an old snapshot
forgets it, and a restarted node would register under an epoch it (or the owners that heard
it) used before: its first records then refused for good, or an old incarnation's records
never ended. The node writes the epoch here (synced, 0600) before it registers with it, and
registers next above both etcd's and this one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

FILE_NAME = "cluster-epoch"


class EpochFile:
    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / FILE_NAME

    def read(self) -> int:
        """The last epoch written (0: none, or a file that does not hold one, which is logged)."""
        try:
            return max(0, int(self.path.read_text().strip()))
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            logger.warning("%s is unreadable (%r); the node's epoch comes from etcd alone", self.path, exc)
            return 0

    def write(self, epoch: int) -> None:
        """Replaces the file with ``epoch``, synced (file and directory) before it returns."""
        tmp = self.path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, f"{epoch}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
