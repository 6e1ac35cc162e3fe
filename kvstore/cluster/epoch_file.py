"""What a node keeps of its cluster membership in its own data directory, for an etcd that was
replaced or restored (DESIGN §12.4): its last registration epoch, and the incarnation id
of the etcd it last caught up with.

More: kvstore/cluster/README.md (### epoch_file.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_WRITES = itertools.count()
FILE_NAME = "cluster-epoch"
INCARNATION_FILE_NAME = "cluster-incarnation"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""
    except OSError as exc:
        logger.warning("%s is unreadable (%r)", path, exc)
        return ""


def _write(path: Path, text: str) -> None:
    """Replaces ``path`` with ``text`` (0600), synced (file and directory) before it returns."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_WRITES)}.tmp")  # writers at once
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{text}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class EpochFile:
    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / FILE_NAME
        self.incarnation_path = data_dir / INCARNATION_FILE_NAME

    def read(self) -> int:
        """The last epoch written (0: none, or a file that does not hold one, which is logged)."""
        text = _read(self.path)
        try:
            return max(0, int(text)) if text else 0
        except ValueError:
            logger.warning("%s does not hold an epoch (%r); the node's epoch comes from etcd alone", self.path, text)
            return 0

    def write(self, epoch: int) -> None:
        _write(self.path, str(epoch))

    def read_incarnation(self) -> bytes:
        """The incarnation id of the etcd this node last caught up with (b"": none known)."""
        return _read(self.incarnation_path).encode()

    def write_incarnation(self, incarnation: bytes) -> None:
        _write(self.incarnation_path, incarnation.decode())
