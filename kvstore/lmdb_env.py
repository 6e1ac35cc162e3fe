"""The LMDB environments kvstore keeps (directory, token log, ssd index): opened private,
and a full map turned into MetadataFull.

Each environment is a directory of its own, 0700 with its files 0600: the token log holds
prompts, the directory and the index tell what was cached. A full map (MDB_MAP_FULL)
aborts the transaction, so nothing was written; callers change what they hold in memory
only after their commit succeeded, so that memory and disk agree.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from kvstore.config import format_size
from kvstore.errors import MetadataFull

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> None:
    """Creates ``path`` (and missing parents) with mode 0700; an existing one is left as it is."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)


def open_env(path: Path, map_bytes: int, **options: Any) -> lmdb.Environment:
    """Opens (creating) the environment in directory ``path``. Its directory and files are
    made private also when an older version created them world-readable."""
    private_dir(path.parent)
    path.mkdir(mode=DIR_MODE, exist_ok=True)
    os.chmod(path, DIR_MODE)
    env = lmdb.open(str(path), map_size=map_bytes, subdir=True, mode=FILE_MODE, **options)
    for name in ("data.mdb", "lock.mdb"):
        if (path / name).exists():
            os.chmod(path / name, FILE_MODE)
    return env


@contextmanager
def map_full(env: lmdb.Environment, what: str) -> Iterator[None]:
    """Raises MetadataFull, naming ``what`` and the flag to raise, for a full map inside."""
    try:
        yield
    except lmdb.MapFullError as exc:
        size = format_size(env.info()["map_size"])
        raise MetadataFull(f"{what} is full (LMDB map of {size}): the change was refused. "
                           "Restart the server with a larger --lmdb-map-size") from exc
