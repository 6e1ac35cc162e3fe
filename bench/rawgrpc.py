"""A bare gRPC byte pump: the limit of moving bytes through Python gRPC on this machine.

Runs as its own process (like kvstore-server) with generic handlers and no processing:
Upload consumes a stream of chunks, Download streams a prebuilt chunk N times.
"""

from __future__ import annotations

import argparse
import struct
import sys
from concurrent import futures

import grpc

_REQ = struct.Struct("<QI")  # total bytes, chunk bytes
OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]


def _upload(request_iterator, context):  # type: ignore[no-untyped-def]
    total = 0
    for chunk in request_iterator:
        total += len(chunk)
    return struct.pack("<Q", total)


def _download(request, context):  # type: ignore[no-untyped-def]
    total, chunk_bytes = _REQ.unpack(request)
    chunk = bytes(chunk_bytes)
    for _ in range(total // chunk_bytes):
        yield chunk


def serve(port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=OPTIONS)
    handlers = {
        "Upload": grpc.stream_unary_rpc_method_handler(_upload),
        "Download": grpc.unary_stream_rpc_method_handler(_download),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("raw.Raw", handlers),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"ready {bound}", flush=True)
    server.wait_for_termination()


async def upload(channel: grpc.aio.Channel, total: int, chunk_bytes: int) -> None:
    call = channel.stream_unary("/raw.Raw/Upload")
    chunk = bytes(chunk_bytes)

    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(total // chunk_bytes):
            yield chunk

    await call(chunks())


async def download(channel: grpc.aio.Channel, total: int, chunk_bytes: int) -> None:
    call = channel.unary_stream("/raw.Raw/Download")
    async for _ in call(_REQ.pack(total, chunk_bytes)):
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    serve(parser.parse_args().port)
    sys.exit(0)
