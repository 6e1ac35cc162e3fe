"""The call socket's wire format (README.md; DESIGN §11 "Same-host paths"). All integers big-endian::

    request   u32 body_bytes | u16 method | u32 timeout_ms | body (the method's protobuf request)
    answer    u32 body_bytes | u8 status  | body (OK: the protobuf response;
                                                   else: "<ErrorClass>\\n<message>", UTF-8)

More: kvstore/callsocket/README.md (### frames.py).
"""

from __future__ import annotations

import struct

REQUEST_HEADER = struct.Struct(">IHI")
ANSWER_HEADER = struct.Struct(">IB")
HELLO = 0
MAX_REQUEST_BYTES = 1 << 20  # above any valid unary request (4096 keys of a Lookup are ~80 KiB)
MAX_ANSWER_BYTES = 16 << 20
CALL_TOKEN_BYTES = 16
MAX_TIMEOUT_MS = (1 << 32) - 1  # the u32 field's range, ~49.7 days

# Method ids are positions here (1-based): append only. The hot path (Lookup, Acquire, Release)
# and the other calls a same-host client makes; no admin calls (Invalidate, Quarantine, Stats,
# Publish/Remove), no node-only or long-running ones (Replicate): those stay on gRPC.
METHODS: tuple[str, ...] = (
    "Directory.Lookup",
    "Data.Acquire",
    "Data.Release",
    "Data.Renew",
    "Data.GetInfo",
    "Data.WhoAmI",
    "Data.Allocate",
    "Data.Commit",
    "Data.Abort",
    "Data.Hint",
    "Data.AppendTokens",
    "Data.GetSession",
    "Data.EndSession",
)
METHOD_IDS = {name: index for index, name in enumerate(METHODS, start=1)}


def timeout_ms(timeout_s: float) -> int:
    """A request's ``timeout_ms`` for ``timeout_s``: at least 1 (0 names none), at most the
    field holds. Why: a client with a deadline of months (an operator's "no timeout", which
    gRPC takes) raised struct.error on every call socket call."""
    return max(1, int(min(timeout_s * 1000, MAX_TIMEOUT_MS)))


def request_frame(method_id: int, timeout_ms: int, body: bytes) -> bytes:
    return REQUEST_HEADER.pack(len(body), method_id, timeout_ms) + body


def answer_frame(status: int, body: bytes) -> bytes:
    return ANSWER_HEADER.pack(len(body), status) + body


def error_body(error_class: str, message: str) -> bytes:
    return f"{error_class}\n{message}".encode()


def parse_error(body: bytes) -> tuple[str, str]:
    """(error class name or "", message) of an error answer's body."""
    name, _, message = body.decode(errors="replace").partition("\n")
    return name, message
