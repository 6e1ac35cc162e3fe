"""Decorators that turn exceptions into gRPC statuses and time every RPC.

The only place that maps exceptions to status codes on the server: expected errors
(KVStoreError) become their status with the message; I/O errors become UNAVAILABLE; a call
whose client left is CANCELLED (nobody hears it, but the metrics count it as what it is);
anything else is logged with its traceback and becomes INTERNAL. The server keeps serving.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc

from kvstore.errors import KVStoreError, StreamCut
from kvstore.status import ERROR_METADATA_KEY, code_for, error_label

logger = logging.getLogger(__name__)
_CANCEL_SETTLE_S = 0.05


def _client_left(context: grpc.ServicerContext, exc: BaseException) -> bool:
    """Whether the client cancelled. A cancel can end grpcio's request iterator a moment
    before the call is marked inactive, so a stream that ended inside a page waits a little
    (an error path only) for the termination to show."""
    if not isinstance(exc, (grpc.RpcError, KVStoreError)):
        return False
    if not context.is_active():
        return True
    if not isinstance(exc, StreamCut):
        return False
    ended = threading.Event()
    if not context.add_callback(ended.set):
        return True
    ended.wait(_CANCEL_SETTLE_S)
    return not context.is_active()


def _abort(context: grpc.ServicerContext, exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if _client_left(context, exc):
        # The client left: grpcio's request iterator raised, or ended and the stream looked cut short.
        return grpc.StatusCode.CANCELLED, "the client cancelled the call"
    code, message = _status(exc)
    if isinstance(exc, KVStoreError):
        context.set_trailing_metadata(((ERROR_METADATA_KEY, error_label(exc)),))
    return code, message


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, KVStoreError):
        return code_for(exc), str(exc)
    if isinstance(exc, OSError):
        logger.error("I/O error: %s", exc)
        return grpc.StatusCode.UNAVAILABLE, f"storage I/O error: {exc}"
    logger.exception("unexpected error")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def reject(context: grpc.ServicerContext, metrics: Any, method: str, exc: KVStoreError) -> NoReturn:
    """Answers ``exc``'s status for a call refused before its servicer method ran (a request
    that does not decode, a stream over the limit)."""
    code, message = _abort(context, exc)
    metrics.rpc_errors.labels(method, code.name).inc()
    context.abort(code, message)
    raise AssertionError("context.abort returned")  # it raises; this tells the type checker


def _failed(servicer: Any, name: str, context: grpc.ServicerContext, exc: Exception) -> None:
    """Answers ``exc``'s status (context.abort raises) and counts it."""
    code, message = _abort(context, exc)
    servicer.metrics.rpc_errors.labels(name, code.name).inc()
    context.abort(code, message)


def unary(method: Callable[..., Any]) -> Callable[..., Any]:
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            _failed(self, name, context, exc)
        finally:
            self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - start)

    return wrapper


def stream(method: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        start = time.perf_counter()
        try:
            yield from method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            _failed(self, name, context, exc)
        finally:
            self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - start)

    return wrapper
