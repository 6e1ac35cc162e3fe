"""A client belongs to the process that connected it.

More: client/README.md (### forked.py).
"""

from __future__ import annotations

import os

from kvstore.errors import KVStoreError


class ProcessCheck:
    """The pid a connection was made in, and the refusal elsewhere."""

    def __init__(self) -> None:
        self.pid = os.getpid()

    @property
    def forked(self) -> bool:
        """True in a process forked from the one that connected."""
        return os.getpid() != self.pid

    def check(self, address: str) -> None:
        """Raises KVStoreError in a forked child: its calls must not touch the parent's connections."""
        if os.getpid() != self.pid:
            raise KVStoreError(f"this client of kvstore-server at {address} was connected in process {self.pid}; "
                               f"process {os.getpid()} is a fork of it and cannot use its connections: "
                               "connect a client of its own after the fork")
