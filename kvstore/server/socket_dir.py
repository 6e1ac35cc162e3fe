"""Where a server binds its Unix sockets (the arena hand-over, the call socket).

In its data directory, unless that path is too long for a socket address (108 bytes on Linux,
100 kept). Then in a private directory under the temp directory, named after the data
directory, so that a restart after SIGKILL takes over the directory the killed server could not
remove rather than leaving one more behind at every kill (the data directory's lock makes it
this server's alone). A directory of that name that is not this user's own 0700 directory (a
symlink, another owner, open to others) may be an attacker's on the same host: it is passed
over for a new random one, as before names were derived.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
from pathlib import Path

from kvstore.unix_paths import fits_socket

logger = logging.getLogger(__name__)

MAX_SOCKET_PATH = 100  # bytes; sun_path holds 108 with its terminating NUL


def arena_socket_path(data_dir: Path, name: str = "arena.sock") -> Path:
    """``DATA_DIR/<name>``, or, when that path is too long for a Unix socket, ``<name>`` in
    ``private_socket_dir(data_dir)``."""
    path = data_dir / name
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    return private_socket_dir(data_dir, name) / name


def private_socket_dir(data_dir: Path, name: str = "arena.sock") -> Path:
    """``$TMPDIR/kvstore-<uid>-<digest of data_dir>``, made 0700 or taken over when it is this
    user's own 0700 directory; otherwise a new ``mkdtemp`` one (0700), also when ``name`` in the
    derived one would not bind (its name is ~17 bytes longer than mkdtemp's: a long $TMPDIR)."""
    digest = hashlib.sha256(os.fsencode(data_dir.resolve())).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"kvstore-{os.geteuid()}-{digest}"
    if not fits_socket(path / name):
        return Path(tempfile.mkdtemp(prefix="kvstore-"))
    try:
        path.mkdir(mode=0o700)
        return path
    except FileExistsError:
        pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:  # removed since the mkdir by its owner (another user's squat may come and go)
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0:
        return path  # a killed server's (its socket files are unlinked before each bind)
    logger.warning("%s is not this user's own 0700 directory; the sockets go to a new one", path)
    return Path(tempfile.mkdtemp(prefix="kvstore-"))
