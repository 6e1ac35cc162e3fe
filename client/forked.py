"""A client belongs to the process that connected it.

A process that forks after its client connected (an engine starting its workers) hands the
child copies of the client's sockets and of its event loops' epoll sets, but not the I/O
runtime's thread. A child that used them would read answers meant for the parent (whichever
process reads a shared socket first gets the bytes), wait forever for a thread it does not
have, or, closing them, take the parent's sockets out of the epoll set both share (an
epoll registration belongs to the open file, which parent and child hold together). So
every way into the server checks the process first and refuses at once, and close() in a
child closes nothing the parent still uses.
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
