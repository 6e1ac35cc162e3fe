"""The largest request each RPC accepts, in bytes, checked before the request is parsed.

A request is parsed whole and its repeated fields materialised before their counts can be
checked; glibc keeps the peak of that in the heap of whichever thread parsed it. Bounding
each method by its largest valid request (from the counts the server allows) keeps what a
caller can make the server hold per call near what a valid call needs: a request over its
bound is INVALID_ARGUMENT unparsed, one over every bound is refused by gRPC unread.
"""

from __future__ import annotations

from kvstore.config import ServerConfig
from kvstore.page_wire.grpc_chunks import MAX_CHUNK_BYTES

SLACK = 64 << 10  # namespace ids, layouts, scalars and framing
KEY_BYTES = 40  # a 16-byte key and its framing, with a checksum or an offset beside it
RECORD_BYTES = 128  # a Publish record or a hinted key: key, location strings, framing
TOKEN_BYTES = 5  # a uint32 token id, varint-packed
MAX_APPEND_TOKENS = 1 << 20


def request_limits(config: ServerConfig) -> dict[str, int]:
    """Per method (by name) the largest request; ``default`` for every other method."""
    keyed = KEY_BYTES * config.max_pages_per_request + SLACK
    records = RECORD_BYTES * config.max_pages_per_request + SLACK
    return {
        "default": keyed,
        "WritePages": MAX_CHUNK_BYTES + SLACK,  # per message of the stream
        "AppendTokens": TOKEN_BYTES * MAX_APPEND_TOKENS + SLACK,
        "Publish": records,
        "Hint": records,
    }


def receive_limit(config: ServerConfig) -> int:
    """gRPC's max_receive_message_length for the server: the largest per-method bound."""
    return max(request_limits(config).values())
