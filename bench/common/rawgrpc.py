"""A bare gRPC byte pump: the limit of moving bytes through Python gRPC on this machine.

Runs as its own process (like kvstore-server) with generic handlers and no processing:
Upload consumes a stream of chunks, Download streams prebuilt chunks, Echo answers a unary
call with its request (the round-trip floor of a small RPC). Every chunk is a
distinct buffer, as the pages of a real transfer are: sending one cached 1 MiB buffer N
times would measure cache bandwidth, a limit no transfer of N MiB of real data can reach.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from concurrent import futures

import grpc

from kvstore.memory import tune_malloc
from kvstore.page_wire.grpc_chunks import MESSAGE_OPTIONS

_REQ = struct.Struct("<QI")  # total bytes, chunk bytes
OPTIONS = MESSAGE_OPTIONS


def _upload(request_iterator, context):  # type: ignore[no-untyped-def]
    total = 0
    for chunk in request_iterator:
        total += len(chunk)
    return struct.pack("<Q", total)


_prebuilt: dict[tuple[int, int], list[bytes]] = {}


def distinct_chunks(total: int, chunk_bytes: int) -> list[bytes]:
    """``total // chunk_bytes`` chunks, each its own memory (built once, then reused)."""
    key = (total, chunk_bytes)
    if key not in _prebuilt:
        _prebuilt.clear()
        seed = os.urandom(chunk_bytes)
        _prebuilt[key] = [bytes(bytearray(seed)) for _ in range(total // chunk_bytes)]
    return _prebuilt[key]


def _download(request, context):  # type: ignore[no-untyped-def]
    total, chunk_bytes = _REQ.unpack(request)
    yield from distinct_chunks(total, chunk_bytes)


def _echo(request, context):  # type: ignore[no-untyped-def]
    return request


def serve(port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=OPTIONS)
    handlers = {
        "Upload": grpc.stream_unary_rpc_method_handler(_upload),
        "Download": grpc.unary_stream_rpc_method_handler(_download),
        "Echo": grpc.unary_unary_rpc_method_handler(_echo),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("raw.Raw", handlers),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"ready {bound}", flush=True)
    server.wait_for_termination()


async def upload(channel: grpc.aio.Channel, total: int, chunk_bytes: int) -> None:
    call = channel.stream_unary("/raw.Raw/Upload")
    await call(iter(distinct_chunks(total, chunk_bytes)))


async def download(channel: grpc.aio.Channel, total: int, chunk_bytes: int) -> None:
    call = channel.unary_stream("/raw.Raw/Download")
    async for _ in call(_REQ.pack(total, chunk_bytes)):
        pass


ECHO = "/raw.Raw/Echo"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    tune_malloc()  # the same settings as kvstore-server, so that the limit is a fair one
    serve(parser.parse_args().port)
    sys.exit(0)
