"""Whose process serves a same-host Unix socket, asked before a client sends it a secret.

The call socket and the arena socket are 0600 in the server's data directory, so only the
server's uid (or root) could have bound them; but a data directory with the wrong modes (or
one under a directory others may write) lets another uid put its own socket at the path, and
both protocols open with the client's bearer token. The peer's uid (SO_PEERCRED, set by the
kernel at connect) must be the client's own or root's before the token is sent: a root client
of a server of another uid is refused too (it then uses gRPC)."""

from __future__ import annotations

import os
import socket
import struct

from kvstore.errors import KVStoreError


def check_served_by_us(sock: socket.socket, path: object) -> None:
    """Raises KVStoreError unless the connected ``sock``'s peer runs as this process's uid or root."""
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid not in (os.getuid(), 0):
        raise KVStoreError(f"{path} is served by uid {uid}, not by this uid ({os.getuid()}) nor root: no token sent to it")
