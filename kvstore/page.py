"""The stored form of a page: a fixed header, then layer-major payload bytes.

More: kvstore/README.md (### page.py).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import xxhash

from kvstore.errors import PageCorrupt
from kvstore.types import KVLayout, page_bytes_of

MAGIC = b"KVPG"
FORMAT_VERSION = 2
HEADER_BYTES = 4096
_BODY_V1 = struct.Struct("<4sHH16s16sIIII16sIQQ")  # format 1: no generation
_BODY = struct.Struct("<4sHH16s16sIIII16sIQQQ")
_CHECK = struct.Struct("<Q")
HEADER_CORE_BYTES = _BODY.size + _CHECK.size  # the meaningful prefix of a packed header (format 2)
HEADER_CORE_BYTES_V1 = _BODY_V1.size + _CHECK.size
GENERATION_AT = _BODY_V1.size  # format 2 only
GENERATION_FIELD = struct.Struct("<Q")
_VERSION_FIELD = struct.Struct("<H")  # at 4, after the magic
# Where fields sit in a packed header, for readers that peek without parsing it (an index
# of a million pages at start-up).
NAMESPACE_AT = struct.calcsize("<4sHH")
KEY_AT = NAMESPACE_AT + 16
PAYLOAD_BYTES_AT = struct.calcsize("<4sHH16s16sIIII16sI")
PAYLOAD_BYTES_FIELD = struct.Struct("<Q")  # at PAYLOAD_BYTES_AT

# The first bytes of the host tier's shared-memory arena (then a 16-byte token): a client
# that finds them, with the token the server announced, shares the server's host.
ARENA_MAGIC = b"KVARENA1"

# Header flags an engine may set (SSD admission reads them).
FLAG_WANTED = 1        # the engine asked to keep this page
FLAG_SESSION_OPEN = 2  # its session is still open (multi-turn, tool wait)
ENGINE_FLAGS = FLAG_WANTED | FLAG_SESSION_OPEN


def checksum(data: object) -> int:
    """xxh3-64 of a buffer (bytes, memoryview, numpy array)."""
    return xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]


def checksummer() -> xxhash.xxh3_64:
    """The incremental form of ``checksum``: ``update`` piece by piece, then ``intdigest``
    equals ``checksum`` of the pieces joined (for bytes checked as they stream past)."""
    return xxhash.xxh3_64()


def checksum_rows(rows: Iterable[object]) -> int:
    """``checksum`` of the rows joined, without joining them (an engine page's strided rows)."""
    h = xxhash.xxh3_64()
    for row in rows:
        h.update(row)  # type: ignore[arg-type]
    return h.intdigest()


@dataclass(frozen=True)
class LayoutDesc:
    """A layout as stored in a header; comparable with ``KVLayout`` without torch."""

    num_layers: int
    kv_factor: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_tokens: int

    @classmethod
    def of(cls, layout: KVLayout) -> LayoutDesc:
        return cls(layout.num_layers, layout.kv_factor, layout.num_kv_heads, layout.head_dim, layout.dtype_name, layout.page_tokens)

    @property
    def page_bytes(self) -> int:
        """0 for an unknown dtype."""
        return page_bytes_of(self.num_layers, self.kv_factor, self.num_kv_heads, self.head_dim, self.dtype, self.page_tokens)


@dataclass(frozen=True)
class PageHeader:
    namespace_id: bytes
    key: bytes
    layout: LayoutDesc
    payload_bytes: int
    checksum: int
    flags: int = 0
    generation: int = 0  # the namespace's generation the page belongs to

    def pack(self) -> bytes:
        """The header padded to HEADER_BYTES."""
        lay = self.layout
        body = _BODY.pack(
            MAGIC, FORMAT_VERSION, self.flags, self.namespace_id, self.key,
            lay.num_layers, lay.kv_factor, lay.num_kv_heads, lay.head_dim, lay.dtype.encode(),
            lay.page_tokens, self.payload_bytes, self.checksum, self.generation,
        )
        packed = body + _CHECK.pack(checksum(body))
        return packed + bytes(HEADER_BYTES - len(packed))

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> PageHeader:
        """Parses and checks a header; raises PageCorrupt when it is not a valid one."""
        if len(data) < HEADER_CORE_BYTES_V1:
            raise PageCorrupt(f"page header truncated: {len(data)} bytes")
        version = _VERSION_FIELD.unpack_from(data, 4)[0]
        shape = _BODY if version == FORMAT_VERSION else _BODY_V1
        if len(data) < shape.size + _CHECK.size:
            raise PageCorrupt(f"page header truncated: {len(data)} bytes")
        body = bytes(data[: shape.size])
        (stored,) = _CHECK.unpack_from(data, shape.size)
        if stored != checksum(body):
            raise PageCorrupt("page header checksum mismatch")
        magic, version, flags, ns, key, nl, kvf, heads, hd, dtype, pt, length, csum, *generation = shape.unpack(body)
        if magic != MAGIC:
            raise PageCorrupt(f"bad page magic {magic!r}")
        if version not in (1, FORMAT_VERSION):
            raise PageCorrupt(f"page format version {version} is not supported (expected 1 or {FORMAT_VERSION})")
        layout = LayoutDesc(nl, kvf, heads, hd, dtype.rstrip(b"\0").decode(), pt)
        return cls(ns, key, layout, length, csum, flags, generation[0] if generation else 0)

    def verify_payload(self, payload: object, length: int, digest: Callable[[object], int] = checksum) -> None:
        """Raises PageCorrupt unless ``payload`` has the recorded length and checksum (computed by ``digest``)."""
        if length != self.payload_bytes:
            raise PageCorrupt(f"page {self.key.hex()} has {length} bytes, header says {self.payload_bytes}")
        if digest(payload) != self.checksum:
            raise PageCorrupt(f"page {self.key.hex()} failed its checksum")


def core_bytes(packed: bytes | memoryview) -> int:
    """How long the meaningful prefix of a packed header is, by its format version."""
    return HEADER_CORE_BYTES if _VERSION_FIELD.unpack_from(packed, 4)[0] == FORMAT_VERSION else HEADER_CORE_BYTES_V1


def peek_generation(packed: bytes | memoryview) -> int:
    """The generation of a packed header, unchecked (0 for format 1)."""
    if _VERSION_FIELD.unpack_from(packed, 4)[0] != FORMAT_VERSION:
        return 0
    return int(GENERATION_FIELD.unpack_from(packed, GENERATION_AT)[0])


def peek(packed: bytes | memoryview) -> tuple[bytes, bytes, int]:
    """(namespace id, key, payload bytes) of a packed header, unchecked: for an index that
    parses (and checks) a header only when the page is first used."""
    return (bytes(packed[NAMESPACE_AT : NAMESPACE_AT + 16]), bytes(packed[KEY_AT : KEY_AT + 16]),
            PAYLOAD_BYTES_FIELD.unpack_from(packed, PAYLOAD_BYTES_AT)[0])
