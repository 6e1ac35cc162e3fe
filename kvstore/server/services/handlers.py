"""Registers every RPC of a service so that requests are decoded by us, not by grpcio, and
streams pass through the StreamGate.

More: kvstore/server/services/README.md (### handlers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from kvstore._proto import data_pb2_grpc
from kvstore.errors import InvalidRequest, LimitExceeded
from kvstore.page_wire.grpc_chunks import decode_chunk
from kvstore.server.services.rpc_errors import reject
from kvstore.server.services.streams import StreamGate, StreamSlot


class _Capture:
    """Stands in for a grpc.Server to catch what a generated ``add_*Servicer_to_server`` registers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, _: object) -> None:
        pass

    def add_registered_method_handlers(self, _: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers = dict(handlers)


def generated_handlers(add_to_server: Callable[[Any, Any], None], servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    """The handlers the generated ``add_to_server`` would register for ``servicer``."""
    capture = _Capture()
    add_to_server(servicer, capture)
    return capture.handlers


def data_handlers(servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    """The Data service's handlers, ReadPages and WritePages moving encoded chunks (bytes,
    see page_wire/grpc_chunks.py) instead of PageChunk objects."""
    handlers = generated_handlers(data_pb2_grpc.add_DataServicer_to_server, servicer)
    handlers["WritePages"] = handlers["WritePages"]._replace(request_deserializer=decode_chunk)
    handlers["ReadPages"] = handlers["ReadPages"]._replace(response_serializer=None)  # the servicer yields encoded chunks
    return handlers


def add_service(server: grpc.Server, service: ServiceDescriptor, handlers: dict[str, grpc.RpcMethodHandler],
                gate: StreamGate, metrics: Any, limits: Mapping[str, int]) -> dict[str, grpc.RpcMethodHandler]:
    """Registers ``handlers`` (one per method of ``service``) on ``server``, guarded; a
    request (a stream's message) over ``limits[name]`` (else ``limits["default"]``) bytes
    is refused before it is parsed. Returns the guarded handlers by full name ("Service.Method"),
    for the same-host call socket (kvstore/callsocket/socket_server.py) to serve the very same code."""
    declared = {m.name for m in service.methods}
    if declared != set(handlers):
        raise RuntimeError(f"{service.full_name}: handlers {sorted(handlers)} do not match the proto's methods {sorted(declared)}")
    guarded = {m.name: _guard(m, handlers[m.name], gate, metrics, limits.get(m.name, limits["default"])) for m in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, guarded),))
    server.add_registered_method_handlers(service.full_name, guarded)
    return {f"{service.name}.{name}": handler for name, handler in guarded.items()}


def _guard(method: MethodDescriptor, handler: grpc.RpcMethodHandler, gate: StreamGate, metrics: Any,
           max_bytes: int) -> grpc.RpcMethodHandler:
    name, deserialize = method.name, handler.request_deserializer or (lambda raw: raw)

    def decode(raw: bytes, index: int | None = None) -> Any:
        if len(raw) > max_bytes:
            which = "request" if index is None else f"message {index} of the request stream"
            raise InvalidRequest(f"{name}: {which} of {len(raw)} bytes is larger than any valid one ({max_bytes})")
        try:
            return deserialize(raw)
        except Exception as exc:  # noqa: BLE001 - any request bytes that do not parse are the caller's error
            which = "the request" if index is None else f"message {index} of the request stream"
            raise InvalidRequest(f"{name}: {which} is not a valid {method.input_type.full_name}: {exc}") from None

    def decode_unary(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            return decode(raw)
        except InvalidRequest as exc:
            reject(context, metrics, name, exc)

    def admit(context: grpc.ServicerContext) -> StreamSlot:
        try:
            return gate.open(name, context)
        except LimitExceeded as exc:
            reject(context, metrics, name, exc)

    def requests(raw_requests: Iterator[bytes], slot: StreamSlot) -> Iterator[Any]:
        """The decoded request stream; a decoding error is raised to the servicer method,
        whose decorator answers it. Idle is only the time spent waiting for the peer."""
        for index, raw in enumerate(raw_requests):
            slot.touch(busy=True)
            yield decode(raw, index)
            slot.touch()  # the servicer asks for the next message: waiting on the peer again
        slot.touch(busy=True)  # the peer is done; the answer is the server's work
        if slot.cancelled:  # the watchdog cancelled the call: the stream is not complete
            raise LimitExceeded(f"{name}: cancelled after {gate.idle_s:.0f} s without a message (--stream-idle-s)")

    def responses(produced: Iterator[Any], slot: StreamSlot) -> Iterator[Any]:
        try:
            for response in produced:
                slot.touch()
                yield response
                slot.touch()
        finally:
            close = getattr(produced, "close", None)
            if close is not None:
                close()
            gate.close(slot)

    serializer = handler.response_serializer
    if not handler.request_streaming and not handler.response_streaming:
        unary_unary = handler.unary_unary
        return grpc.unary_unary_rpc_method_handler(
            lambda raw, context: unary_unary(decode_unary(raw, context), context), response_serializer=serializer)

    if not handler.request_streaming:
        unary_stream = handler.unary_stream

        def serve_unary_stream(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
            request = decode_unary(raw, context)  # inside the generator: a call never started takes no slot
            yield from responses(unary_stream(request, context), admit(context))

        return grpc.unary_stream_rpc_method_handler(serve_unary_stream, response_serializer=serializer)

    if not handler.response_streaming:
        stream_unary = handler.stream_unary

        def serve_stream_unary(raw_requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            slot = admit(context)
            try:
                return stream_unary(requests(raw_requests, slot), context)
            finally:
                gate.close(slot)

        return grpc.stream_unary_rpc_method_handler(serve_stream_unary, response_serializer=serializer)

    stream_stream = handler.stream_stream

    def serve_stream_stream(raw_requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
        slot = admit(context)
        yield from responses(stream_stream(requests(raw_requests, slot), context), slot)

    return grpc.stream_stream_rpc_method_handler(serve_stream_stream, response_serializer=serializer)
