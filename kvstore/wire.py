"""Pages on the socket: how a page is cut into PageChunk messages and put back together.

The first chunk of a page carries its namespace and layout; every chunk carries the key,
the total length and the checksum, so a receiver can check order, length and checksum
without trusting the sender. Used by the server (ReadPages) and the client (writes); the
client's reassembly is kvstore.client.wire.PageAssembler.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvstore._proto import common_pb2, data_pb2

CHUNK_BYTES = 1 << 20


def page_chunks(key: bytes, namespace_id: bytes, layout: common_pb2.Layout, data: memoryview, page_checksum: int,
                durable: bool = False, chunk_bytes: int = CHUNK_BYTES) -> Iterator[data_pb2.PageChunk]:
    size = len(data)
    for start in range(0, size, chunk_bytes):
        first = start == 0
        yield data_pb2.PageChunk(
            key=key, offset=start, data=bytes(data[start : start + chunk_bytes]), page_bytes=size, checksum=page_checksum,
            namespace_id=namespace_id if first else b"", layout=layout if first else None, durable=durable,
        )
