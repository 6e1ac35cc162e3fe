"""What a handler sees of a call that came over the call socket: the part of
grpc.ServicerContext the guarded handlers use (``abort`` raises ``Aborted``, the error class
from the trailing metadata, ``time_remaining``, the caller's metadata and peer), so that the
very same handlers serve both transports.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import grpc

from kvstore.status import ERROR_METADATA_KEY


class Aborted(Exception):
    """Raised by LocalContext.abort: the call ends with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class LocalContext:
    """One call's context on the call channel. Not thread-safe (one call, one thread)."""

    def __init__(self, peer: str, authorization: str | None, timeout_s: float) -> None:
        self._peer = peer
        self._metadata = (("authorization", authorization),) if authorization else ()
        self._deadline = time.monotonic() + timeout_s
        self.error_class = ""

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise Aborted(code, details)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        for key, value in metadata:
            if key == ERROR_METADATA_KEY:
                self.error_class = str(value)

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        """A unary call's answer is written once it returns: the caller is there until then
        as far as the handler can tell (a caller gone is seen when the answer is written)."""
        return True

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return True  # never called back: the call ends when the handler returns

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict[str, Any]:
        return {}  # no TLS on a Unix socket: no client certificate
