"""Accepting on a listening socket while out of file descriptors, written once for the call
socket (kvstore/callsocket/socket_server.py) and the arena socket (security/arena_socket.py).

Out of descriptors (EMFILE, ENFILE) ``accept`` fails but the connection stays in the backlog:
a blocking accept fails again at once and a selector says the socket is readable again at
once. Retried at once, that is a loop at full CPU logging a line a turn. ``AcceptPause`` makes
it a pause of ``RETRY_S`` between tries, with a warning at most once per Throttled interval.
"""

from __future__ import annotations

import logging
import time

from kvstore.logs import Throttled

RETRY_S = 0.05  # accepting pauses this long after a failed accept (reads of accepted connections go on)


class AcceptPause:
    """When a listener that failed to accept may try again. Used by one thread (its loop's)."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._errors = Throttled(logger)
        self._what = what
        self.until: float | None = None  # time.monotonic() the pause ends at; None: accepting
        self.num_failed = 0  # accepts that failed: with the pause, at most about one per RETRY_S

    def failed(self, exc: OSError) -> float:
        """Notes a failed accept (a throttled warning) and starts a pause; its length in seconds."""
        self.num_failed += 1
        self._errors.warning("accept", "%s: accept failed (%s); retrying", self._what, exc)
        self.until = time.monotonic() + RETRY_S
        return RETRY_S

    def ended(self, now: float) -> bool:
        """True once, when the pause ``failed`` started is over: accepting goes on."""
        if self.until is None or now < self.until:
            return False
        self.until = None
        return True
