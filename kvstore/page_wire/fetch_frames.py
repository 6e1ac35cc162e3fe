"""The node-to-node page fetch protocol (DESIGN §12.3), independent of the transport that carries it (UCX
now; a gRPC stream would carry the same frames).

More: kvstore/page_wire/README.md (### fetch_frames.py).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidRequest
from kvstore.page import LayoutDesc
from kvstore.types import PAGE_KEY_BYTES

VERSION = 4  # 2: requests name the receiver's generation; 3: a sender hashes a page before sending only if asked (VERIFY);
# 4: a request may ask for a byte range of each page, of pages stored or of an allocation not committed
# yet (PENDING: a handoff's layers as the prefill computes them, DESIGN §12.7)
MAX_KEYS = 8192                 # a 128K-token prefix of 16-token pages
MAX_PAGE_BYTES = 1 << 30
_REQUEST = struct.Struct("<4sHHQ16sQIQQQ16s")
_ANSWER = struct.Struct("<4sHHQI")
_ENTRY = struct.Struct("<B7xQQ")
_LAYOUT = struct.Struct("<IIII16sI")
MAX_FRAME_BYTES = max(_REQUEST.size + MAX_KEYS * PAGE_KEY_BYTES, _ANSWER.size + MAX_KEYS * _ENTRY.size + _LAYOUT.size)
_HELLO = struct.Struct("<4sH2x16s")
HELLO_BYTES = _HELLO.size
DESCRIBE = 1  # request flag: answer statuses (and the layout), send no payload
VERIFY = 2    # request flag: hash each page before it is sent; one that fails is reported damaged, never sent
PENDING = 4   # request flag: pages of the sender's allocation ``allocation``, not committed yet (no checksum: 0)
LAYOUT = 1    # answer flag: the namespace's layout follows the entries
NO_ALLOCATION = bytes(16)


def encode_layout(layout: LayoutDesc) -> bytes:
    return _LAYOUT.pack(layout.num_layers, layout.kv_factor, layout.num_kv_heads, layout.head_dim, layout.dtype.encode(),
                        layout.page_tokens)


def decode_layout(data: bytes | bytearray | memoryview, offset: int) -> LayoutDesc:
    layers, kv, heads, dim, dtype, tokens = _LAYOUT.unpack_from(data, offset)
    try:
        name = bytes(dtype).rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise InvalidRequest("fetch answer names a dtype that is not ASCII") from None
    layout = LayoutDesc(layers, kv, heads, dim, name, tokens)
    if layout.page_bytes <= 0:
        raise InvalidRequest(f"fetch answer carries an unusable layout {layout}")
    return layout


class PageStatus(enum.IntEnum):
    FOUND = 0
    MISSING = 1
    WRONG_SIZE = 2  # held, but not of the size the receiver posted: not sent


@dataclass(frozen=True)
class FetchRequest:
    request_id: int
    namespace_id: bytes
    page_bytes: int
    keys: tuple[bytes, ...]
    flags: int = 0
    generation: int = 0
    offset: int = 0  # each FOUND page is sent from this byte on; never with VERIFY
    length: int = 0  # ... this many bytes of it (0: to its end)
    allocation: bytes = NO_ALLOCATION  # with PENDING: the sender's allocation handle

    def encode(self) -> bytes:
        return _REQUEST.pack(b"KVFQ", VERSION, self.flags, self.request_id, self.namespace_id, self.page_bytes,
                             len(self.keys), self.generation, self.offset, self.length, self.allocation) + b"".join(self.keys)

    @property
    def sent_bytes(self) -> int:
        """Bytes of each FOUND page on the wire."""
        return self.length or self.page_bytes - self.offset

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> FetchRequest:
        """Parses a request; raises InvalidRequest for anything malformed or out of bounds."""
        if len(data) < _REQUEST.size:
            raise InvalidRequest(f"fetch request of {len(data)} bytes is truncated")
        magic, version, flags, rid, ns, page_bytes, n, generation, offset, length, allocation = _REQUEST.unpack_from(data)
        if magic != b"KVFQ" or version != VERSION:
            raise InvalidRequest(f"not a fetch request of version {VERSION} ({bytes(magic)!r} v{version})")
        if not 0 < n <= MAX_KEYS or not 0 < page_bytes <= MAX_PAGE_BYTES:
            raise InvalidRequest(f"fetch request out of bounds: {n} keys of {page_bytes} bytes")
        if len(data) != _REQUEST.size + n * PAGE_KEY_BYTES:
            raise InvalidRequest(f"fetch request of {len(data)} bytes does not hold {n} keys")
        ranged = bool(offset or length or flags & PENDING)
        if offset >= page_bytes or length > page_bytes - offset or (ranged and flags & (VERIFY | DESCRIBE)):
            raise InvalidRequest(f"fetch request of {length or 'all'} bytes from byte {offset} of {page_bytes}-byte pages "
                                 "(never verified or described)")
        if bool(flags & PENDING) == (allocation == NO_ALLOCATION):
            raise InvalidRequest("a fetch of pending pages names their allocation, and only it does")
        raw = bytes(data[_REQUEST.size:])
        keys = tuple(raw[i: i + PAGE_KEY_BYTES] for i in range(0, len(raw), PAGE_KEY_BYTES))
        return cls(rid, bytes(ns), page_bytes, keys, flags & (DESCRIBE | VERIFY | PENDING), generation, offset, length,
                   bytes(allocation))


@dataclass(frozen=True)
class PageEntry:
    status: PageStatus
    payload_bytes: int = 0
    checksum: int = 0


@dataclass(frozen=True)
class FetchAnswer:
    request_id: int
    entries: tuple[PageEntry, ...]
    layout: LayoutDesc | None = None

    def encode(self) -> bytes:
        flags = LAYOUT if self.layout is not None else 0
        return _ANSWER.pack(b"KVFA", VERSION, flags, self.request_id, len(self.entries)) + b"".join(
            _ENTRY.pack(e.status, e.payload_bytes, e.checksum) for e in self.entries) + (
            encode_layout(self.layout) if self.layout is not None else b"")

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, request: FetchRequest) -> FetchAnswer:
        """Parses the answer to ``request``; raises InvalidRequest unless it answers exactly
        that request (same id, one entry per key, found pages of the posted size)."""
        if len(data) < _ANSWER.size:
            raise InvalidRequest(f"fetch answer of {len(data)} bytes is truncated")
        magic, version, flags, rid, n = _ANSWER.unpack_from(data)
        if magic != b"KVFA" or version != VERSION or rid != request.request_id or n != len(request.keys):
            raise InvalidRequest(f"fetch answer does not answer request {request.request_id}")
        tail = _LAYOUT.size if flags & LAYOUT else 0
        if len(data) != _ANSWER.size + n * _ENTRY.size + tail:
            raise InvalidRequest(f"fetch answer of {len(data)} bytes does not hold {n} entries")
        entries = []
        for i in range(n):
            status, length, csum = _ENTRY.unpack_from(data, _ANSWER.size + i * _ENTRY.size)
            try:
                st = PageStatus(status)
            except ValueError:
                raise InvalidRequest(f"fetch answer entry {i} has unknown status {status}") from None
            if st is PageStatus.FOUND and length != request.page_bytes:
                raise InvalidRequest(f"fetch answer entry {i} is {length} bytes, {request.page_bytes} were posted")
            entries.append(PageEntry(st, length, csum))
        layout = decode_layout(data, _ANSWER.size + n * _ENTRY.size) if tail else None
        return cls(rid, tuple(entries), layout)


def encode_hello(grant: bytes) -> bytes:
    return _HELLO.pack(b"KVFH", VERSION, grant)


def decode_hello(data: bytes | bytearray | memoryview) -> bytes:
    """The grant a connection's first frame presents; InvalidRequest when it is no hello."""
    if len(data) != _HELLO.size:
        raise InvalidRequest(f"a hello of {len(data)} bytes, not {_HELLO.size}")
    magic, version, grant = _HELLO.unpack(data)
    if magic != b"KVFH" or version != VERSION:
        raise InvalidRequest(f"not a hello of version {VERSION} ({bytes(magic)!r} v{version})")
    return bytes(grant)


def check_keys(namespace_id: bytes, keys: Sequence[bytes]) -> None:
    if len(namespace_id) != 16:
        raise InvalidRequest("namespace_id must be 16 bytes")
    if not 0 < len(keys) <= MAX_KEYS:
        raise InvalidRequest(f"a fetch asks for 1..{MAX_KEYS} keys, got {len(keys)}")
    for key in keys:
        if len(key) != PAGE_KEY_BYTES:
            raise InvalidRequest(f"page keys are {PAGE_KEY_BYTES} bytes, got {len(key)}")
