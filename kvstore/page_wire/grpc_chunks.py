"""A page on a gRPC stream (ReadPages, WritePages; DESIGN §4, §8): PageChunk messages encoded and
decoded without copying page bytes through protobuf objects, and put back together at the other end.

An encoded chunk is a valid ``PageChunk`` of proto/kvstore/v1/data.proto (its small fields serialised
by protobuf, field 7 ``data`` appended by hand), and ``decode_chunk`` reads any valid one. The payload
is copied once into the bytes gRPC sends and handed out as a view of the bytes it received. The first
chunk of a page carries its namespace and layout; every chunk carries the key, the total length and
the checksum, so a receiver (``ChunkedPage``) checks order, length and checksum without trusting the
sender. The node-to-node fetch frames are ``fetch_frames``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from kvstore._proto import common_pb2, data_pb2
from kvstore.errors import InvalidRequest, KVStoreError, PageCorrupt
from kvstore.page import checksum, checksum_rows, checksummer
from kvstore.pagecopy import copy_checksum_bytes, copy_streamed, frame_checksummed

MAX_MESSAGE_BYTES = 256 << 20
# gRPC options both ends set: a message (a page chunk, a lookup of 65,536 keys) may be this large.
MESSAGE_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
# A client's or a peer's channel: its own connection (gRPC otherwise shares one per address across the
# process, and a new client reused one backing off from a server that was down: refused for seconds after
# the server was back), retried at most a second apart (gRPC's default backs off up to 120 s). gRPC takes
# min_reconnect_backoff_ms as the least time one connection attempt is given to get the server's SETTINGS
# frame, not as a floor on the backoff: at 100 ms a slower handshake could never connect (DESIGN §8).
CLIENT_OPTIONS = [
    *MESSAGE_OPTIONS,
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 20_000),  # gRPC's own default
    ("grpc.max_reconnect_backoff_ms", 1000),
]
CHUNK_BYTES = 4 << 20  # a page up to 4 MiB is one message (a 2.25 MiB Qwen3-8B page: one, not three)
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 4096, 8 << 20  # what a ReadPages request or a client may ask for
# PageChunk.next_keys holds at most this many keys: 40 KiB with their framing, within the slack a WritePages
# message has beside its payload (kvstore/server/services/sizes.py).
MAX_ANNOUNCED_KEYS = 1024


def announced(keys: Sequence[bytes], i: int) -> Sequence[bytes]:
    """What page ``i`` of a WritePages stream of ``keys`` announces (PageChunk.next_keys): the keys after it,
    from every MAX_ANNOUNCED_KEYS-th page on, so that the server allocates and commits the stream's pages in groups."""
    return keys[i + 1 : i + MAX_ANNOUNCED_KEYS] if i % MAX_ANNOUNCED_KEYS == 0 else ()


def check_chunk_bytes(chunk_bytes: int) -> None:
    """Raises InvalidRequest unless ``chunk_bytes`` is a message size both sides accept."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise InvalidRequest(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")


SERVICE = "kvstore.v1.Data"
WRITE_PAGES = f"/{SERVICE}/WritePages"
READ_PAGES = f"/{SERVICE}/ReadPages"
_DATA_FIELD = 7
_DATA_TAG = (_DATA_FIELD << 3) | 2  # field 7, length-delimited
_CHECKSUM_TAG = (5 << 3) | 0  # field 5, varint


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_DATA_TAG_BYTES = encode_varint(_DATA_TAG)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def encode_chunk(meta: data_pb2.PageChunk, *parts: Any) -> bytes:
    """``meta`` (a PageChunk without data) plus the concatenated ``parts`` as its data, as one
    encoded PageChunk; the payload is copied once (bytes.join releases the GIL for large
    copies)."""
    size = sum(memoryview(part).nbytes for part in parts)
    return b"".join((meta.SerializeToString(), _DATA_TAG_BYTES, encode_varint(size), *parts))


class Pieces(Protocol):
    """A page whose bytes are not one buffer (e.g. rows of an engine's KV tensor): its
    ``rows`` (2-D uint8, each row contiguous) hold its bytes in order."""

    nbytes: int
    rows: np.ndarray

    def pieces(self, start: int, end: int) -> list[memoryview]: ...


def page_chunks(key: bytes, namespace_id: bytes, layout: common_pb2.Layout, data: Any, page_checksum: int | None,
                durable: bool = False, chunk_bytes: int = CHUNK_BYTES, flags: int = 0, parent: bytes = b"",
                generation: int | None = None, session_id: str = "", next_keys: Sequence[bytes] = ()) -> Iterator[bytes]:
    """The encoded chunks of one page; ``data`` is its payload: any buffer, or ``Pieces``.
    With ``page_checksum`` None the checksum is computed here: for a page that fits one
    chunk while its bytes are copied into the message (written after them as a 10-byte
    varint, which keeps the message size known before the hash), else in a pass of its own.
    ``generation``: the namespace generation the writer computed the page in; ``session_id``: the
    session it is saved for (refused once the session is fenced at the server); ``next_keys``: the keys of the
    pages that follow it in the stream (``announced``); all three in its first chunk."""
    named: dict[str, Any] = {} if generation is None else {"generation": generation}
    if session_id:
        named["session_id"] = session_id
    if next_keys:
        named["next_keys"] = next_keys
    if hasattr(data, "pieces"):
        size, cut, rows = data.nbytes, data.pieces, data.rows
    else:
        view = memoryview(data).cast("B")
        size, cut = len(view), lambda start, end: [view[start:end]]
        rows = np.frombuffer(view, dtype=np.uint8).reshape(1, -1)
    if page_checksum is None and size <= chunk_bytes:
        meta = data_pb2.PageChunk(key=key, page_bytes=size, durable=durable, namespace_id=namespace_id, layout=layout, flags=flags,
                                  parent=parent, **named)
        head = b"".join((meta.SerializeToString(), _DATA_TAG_BYTES, encode_varint(size)))
        yield frame_checksummed(head, rows, _CHECKSUM_TAG)[0]
        return
    if page_checksum is None:
        page_checksum = checksum_rows(rows)
    for start in range(0, size, chunk_bytes):
        first = start == 0
        meta = data_pb2.PageChunk(
            key=key, offset=start, page_bytes=size, checksum=page_checksum, durable=durable,
            namespace_id=namespace_id if first else b"", layout=layout if first else None, flags=flags if first else 0,
            parent=parent if first else b"", **(named if first else {}),
        )
        yield encode_chunk(meta, *cut(start, min(size, start + chunk_bytes)))


def checked_page_chunks(key: bytes, namespace_id: bytes, layout: common_pb2.Layout, data: Any, page_checksum: int,
                        chunk_bytes: int = CHUNK_BYTES) -> list[bytes] | None:
    """The encoded chunks of a stored page, or None when its bytes no longer match
    ``page_checksum`` (damaged where they are kept: a slot of a shared arena may be written by
    whoever maps it). What is checked is what is sent: a page of one chunk is hashed while
    it is copied into its message; a longer one is copied once, then hashed, then cut."""
    view = memoryview(data).cast("B")
    if len(view) <= chunk_bytes:
        meta = data_pb2.PageChunk(key=key, page_bytes=len(view), namespace_id=namespace_id, layout=layout)
        head = b"".join((meta.SerializeToString(), _DATA_TAG_BYTES, encode_varint(len(view))))
        message, found = frame_checksummed(head, np.frombuffer(view, dtype=np.uint8).reshape(1, -1), _CHECKSUM_TAG)
        return [message] if found == page_checksum else None
    copy = bytes(view)
    if checksum_rows(np.frombuffer(copy, dtype=np.uint8).reshape(1, -1)) != page_checksum:
        return None
    return list(page_chunks(key, namespace_id, layout, copy, page_checksum, chunk_bytes=chunk_bytes))


class WireChunk:
    """A received PageChunk: its small fields parsed, its payload a view of the received
    bytes. ``error`` is set (and the fields empty) when the bytes are not a PageChunk, so
    that the handler can answer INVALID_ARGUMENT instead of gRPC's opaque deserialisation
    failure."""

    __slots__ = ("data", "error", "meta")

    def __init__(self, meta: data_pb2.PageChunk, data: memoryview, error: str | None = None) -> None:
        self.meta = meta
        self.data = data
        self.error = error

    key = property(lambda self: self.meta.key)
    namespace_id = property(lambda self: self.meta.namespace_id)
    layout = property(lambda self: self.meta.layout)
    page_bytes = property(lambda self: self.meta.page_bytes)
    checksum = property(lambda self: self.meta.checksum)
    offset = property(lambda self: self.meta.offset)
    durable = property(lambda self: self.meta.durable)
    flags = property(lambda self: self.meta.flags)


def decode_chunk(raw: bytes) -> WireChunk:
    """Splits an encoded PageChunk into its small fields (parsed by protobuf) and a view of
    its payload; never raises."""
    view = memoryview(raw)
    data = view[0:0]
    spans: list[bytes] = []
    pos, end = 0, len(raw)
    try:
        while pos < end:
            start = pos
            tag, pos = _read_varint(raw, pos)
            wire_type = tag & 7
            if wire_type == 0:
                _, pos = _read_varint(raw, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = _read_varint(raw, pos)
                if pos + length > end:
                    raise ValueError(f"field {tag >> 3} runs past the end of the message")
                if tag == _DATA_TAG:
                    data = view[pos : pos + length]
                    pos += length
                    continue
                pos += length
            else:
                raise ValueError(f"unsupported wire type {wire_type}")
            if pos > end:
                raise ValueError("message truncated")
            spans.append(raw[start:pos])
        meta = data_pb2.PageChunk.FromString(b"".join(spans))
    except Exception as exc:  # noqa: BLE001 - any malformed input becomes a clear error
        return WireChunk(data_pb2.PageChunk(), view[0:0], f"malformed PageChunk: {exc}")
    return WireChunk(meta, data)


class PageStubs:
    """Client calls of ReadPages/WritePages that send encoded chunks and receive raw bytes
    (decode each with ``decode_chunk``). Works on sync and asyncio channels alike."""

    def __init__(self, channel: Any) -> None:
        self.write_pages = channel.stream_unary(
            WRITE_PAGES, request_serializer=None, response_deserializer=data_pb2.WritePagesResponse.FromString)
        self.read_pages = channel.unary_stream(
            READ_PAGES, request_serializer=data_pb2.ReadPagesRequest.SerializeToString, response_deserializer=None)


# Putting a page back together from its chunks, written once for both ends: the server's WritePages and
# the client's ReadPages. Who is to blame for a malformed stream differs (a client sending bad chunks is an
# invalid request; a server sending them is corrupt data), so the caller names the error class.


class PageSink(Protocol):
    """Where the bytes of one page go as they arrive (layer-major offsets)."""

    def write(self, start: int, data: memoryview) -> None: ...

    def write_all(self, data: memoryview) -> int:
        """Writes the whole page and returns the checksum of its bytes, in one pass."""
        ...

    def clear(self) -> None:
        """Forgets unverified bytes (a page that failed must not reach its reader)."""
        ...


class BufferSink:
    """A page into one contiguous buffer (a host-tier slot, a page tensor's bytes)."""

    def __init__(self, dest: memoryview, clear_on_failure: bool = True) -> None:
        self.dest = dest
        self.clear_on_failure = clear_on_failure

    def write(self, start: int, data: memoryview) -> None:
        dest = self.dest[start : start + len(data)]
        if not copy_streamed(dest, data):  # the native copy (GIL released) when there is one
            dest[:] = data

    def write_all(self, data: memoryview) -> int:
        return copy_checksum_bytes(self.dest, data)

    def clear(self) -> None:
        if self.clear_on_failure:
            self.dest[:] = bytes(len(self.dest))


class ChunkedPage:
    """One page arriving as chunks, in order: each must continue where the last ended and the page
    must not overrun its length. The bytes go to the ``sink`` (none: they are only checked) and are
    hashed as they pass, so a page is copied once; a page sent whole in one chunk (up to 4 MiB, the
    default) is copied and hashed in one pass. The page counts only once its checksum holds; until
    then its sink holds unverified bytes, which ``abandon`` clears. ``label`` names it in errors;
    ``malformed`` is raised for chunks out of order or past the page's length, PageCorrupt for a bad
    checksum. Not ``verify``: the bytes are copied unhashed and the page counts once whole, each of
    its chunks naming the first one's length and checksum (a node's landing: the copy that consumes
    the page checks it, DESIGN §4)."""

    def __init__(self, key: bytes, page_bytes: int, expected: int, sink: PageSink | None, label: str,
                 malformed: type[KVStoreError], verify: bool = True) -> None:
        self.key = key
        self.page_bytes = page_bytes
        self.expected = expected
        self.sink = sink
        self.label = label
        self.malformed = malformed
        self.verify = verify
        self.filled = 0
        self._hash = checksummer()

    def add(self, chunk: WireChunk) -> bool:
        """Takes the next chunk; True when the page is complete (and, verified, its checksum holds)."""
        if chunk.key != self.key or chunk.offset != self.filled:
            raise self.malformed(f"out-of-order chunk of {self.label}: at offset {chunk.offset}, expected {self.filled}")
        end = self.filled + len(chunk.data)
        if end > self.page_bytes:
            raise self.malformed(f"{self.label} got more than its {self.page_bytes} bytes")
        if not self.verify:
            return self._copied(chunk, end)
        if end == self.page_bytes and self.filled == 0:  # the whole page in one chunk: copy and hash in one pass
            self.filled = end  # written, not yet verified
            digest = checksum(chunk.data) if self.sink is None else self.sink.write_all(chunk.data)
        else:
            if self.sink is not None:
                self.sink.write(self.filled, chunk.data)
            self._hash.update(chunk.data)
            self.filled = end
            if end < self.page_bytes:
                return False
            digest = self._hash.intdigest()
        if digest != self.expected:
            raise PageCorrupt(f"{self.label} failed its checksum")
        return True

    def _copied(self, chunk: WireChunk, end: int) -> bool:
        """An unverified page's chunk copied: whether the page is whole. Its chunks must agree on
        what the page is, as the checksum it is committed with is theirs."""
        if chunk.page_bytes != self.page_bytes or chunk.checksum != self.expected:
            raise self.malformed(f"a chunk of {self.label} names another length or checksum than its first")
        if self.sink is not None:
            self.sink.write(self.filled, chunk.data)
        self.filled = end
        return end == self.page_bytes

    def abandon(self) -> None:
        """The stream ended or failed: unverified bytes in the sink are cleared."""
        if self.sink is not None and self.filled:
            self.sink.clear()
        self.filled = 0

    def truncated(self) -> KVStoreError:
        return self.malformed(f"{self.label} ended after {self.filled} of {self.page_bytes} bytes")
