"""How the fuzzer (fuzz.py) makes one call of any kind with raw bytes, and what it calls an
answer: unary calls wait for their status; client streams send their messages (or stop
mid-stream and are cancelled); server streams are read briefly and cancelled.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor

from kvstore.aio_status import KeptStatus
from kvstore.bench.fuzz.fuzz_cases import Pools

CALL_TIMEOUT_S = 30.0  # a unary call still unanswered then is a hang
STREAM_READ_S = 0.3  # a server stream is read this long at most, then cancelled
CANCELLED_BY_US = "CANCELLED(by fuzzer)"
# grpc.aio's own status when it fails to send a message because the server already ended
# the call (a refused client stream) and the server's answer could not be kept (a bidirectional
# stream; unary-answer streams keep it: kvstore/aio_status.py). It is
# told apart by grpc's debug string and checked against the server's own error counts.
CLIENT_SEND_FAILED = "INTERNAL(client: send after the server ended the call)"
BAD_CALLERS = ("none", "wrong-token", "malformed")


@dataclass
class Case:
    method: MethodDescriptor
    caller: str  # a tenant, "admin", or one of BAD_CALLERS
    pools: Pools  # whose namespace and handles the request uses
    token: str | None
    metadata: tuple[tuple[str, str], ...]
    strategy: str
    requests: list[bytes]
    request: Any = None  # the valid or mutated message (None: damaged bytes), for learning from the answer
    page_keys: list[bytes] = field(default_factory=list)
    cancel_after: int | None = None  # client stream: cancel once this many messages are sent


async def call(channel: grpc.aio.Channel, case: Case) -> Any:
    """The raw answer (bytes: the response, or a server stream's last message), or None when
    the fuzzer cancelled the call. Raises AioRpcError with the status otherwise."""
    path = f"/{case.method.containing_service.full_name}/{case.method.name}"
    m, md = case.method, case.metadata
    if not m.client_streaming and not m.server_streaming:
        return await channel.unary_unary(path)(case.requests[0], metadata=md, timeout=CALL_TIMEOUT_S)
    if m.client_streaming:
        cut = asyncio.Event()

        async def send() -> Any:
            for i, raw in enumerate(case.requests):
                if case.cancel_after is not None and i == case.cancel_after:
                    cut.set()
                    await asyncio.Event().wait()  # the call is cancelled while this waits
                yield raw

        if m.server_streaming:
            call = channel.stream_stream(path)(send(), metadata=md, timeout=CALL_TIMEOUT_S)
            return await _read(call)
        call = channel.stream_unary(path)(send(), metadata=md, timeout=CALL_TIMEOUT_S)
        kept = KeptStatus(call)  # the server's status where grpc.aio overwrites it (kvstore/aio_status.py)
        if case.cancel_after is None:
            return await _answer(call, kept)
        waiter = asyncio.ensure_future(cut.wait())
        await asyncio.wait([waiter, asyncio.ensure_future(call.code())], return_when=asyncio.FIRST_COMPLETED)
        if not call.done():
            call.cancel()
            await call.code()
            return None
        waiter.cancel()
        return await _answer(call, kept)
    return await _read(channel.unary_stream(path)(case.requests[0], metadata=md, timeout=CALL_TIMEOUT_S))

async def _answer(call: Any, kept: KeptStatus) -> Any:
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise kept.instead_of(exc) from None


async def _read(call: Any) -> Any:
    """Reads a server stream for STREAM_READ_S at most, then cancels it; the last message
    (or b"") when it ended by itself, None when cancelled."""
    last: Any = b""
    loop = asyncio.get_running_loop()
    end = loop.time() + STREAM_READ_S
    while loop.time() < end:
        try:
            message = await asyncio.wait_for(call.read(), end - loop.time())
        except TimeoutError:
            break
        if message is grpc.aio.EOF:
            return last
        last = message
    call.cancel()
    code = await call.code()
    if code != grpc.StatusCode.CANCELLED:  # it ended on its own just before the cancel
        if code != grpc.StatusCode.OK:
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), await call.details())
        return last
    return None

def client_send_failed(exc: grpc.aio.AioRpcError, case: Case) -> bool:
    return (case.method.client_streaming and exc.code() == grpc.StatusCode.INTERNAL
            and exc.details() == "Internal error from Core" and "SendMessageOperation" in (exc.debug_error_string() or ""))


