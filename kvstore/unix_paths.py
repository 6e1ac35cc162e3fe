"""How long a Unix socket's path may be: ``sockaddr_un.sun_path`` holds 108 bytes with its
terminating NUL. One place for the bound every socket the server binds is checked against."""

from __future__ import annotations

import os
from pathlib import Path

from kvstore.errors import ConfigError

SUN_PATH_MAX = 107


def fits_socket(path: Path | str) -> bool:
    return len(os.fsencode(path)) <= SUN_PATH_MAX


def check_socket_path(path: Path | str) -> None:
    """ConfigError, naming the flag to change, for a path no socket can be bound at."""
    if not fits_socket(path):
        raise ConfigError(f"{path}: a Unix socket path is at most {SUN_PATH_MAX} bytes; use a shorter --data-dir")
