"""The slab size the SSD tier's pages were placed with, kept beside its data file.

Slot offsets in ``pages.dat`` follow a grid of slabs; the size of a slab is derived from
--ssd-capacity when the tier is made. A restart with another capacity must keep the grid the
stored pages lie on, or their slots no longer line up and the index entries are dropped
(``ssd.SsdTier._slab_bytes``). A small file, not the LMDB index: it is written once, and
the index's map stays what --lmdb-map-size says it holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvstore.lmdb_env import FILE_MODE

FILE_NAME = "slabs.json"


def stored_slab_bytes(directory: Path) -> int | None:
    """The slab size kept in ``directory``; None when none was kept (a new tier, or one an
    older version made)."""
    try:
        return int(json.loads((directory / FILE_NAME).read_text())["slab_bytes"])
    except FileNotFoundError:
        return None


def keep_slab_bytes(directory: Path, slab_bytes: int) -> None:
    """Writes the slab size durably (temporary file, fsync, rename, fsync of the directory)."""
    tmp = directory / f".{FILE_NAME}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.write(fd, json.dumps({"slab_bytes": slab_bytes}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / FILE_NAME)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
