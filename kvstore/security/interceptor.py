"""A gRPC server interceptor that authenticates every call before its handler runs, and
makes the caller's Identity available to the handler through ``current_identity()``.

More: kvstore/security/README.md (### interceptor.py).
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvstore.errors import TierUnavailable, Unauthenticated
from kvstore.security.authenticator import Authenticator, PeerCertificate
from kvstore.security.identity import Identity

logger = logging.getLogger(__name__)

_IDENTITY: contextvars.ContextVar[Identity] = contextvars.ContextVar("kvstore_identity")


def current_identity() -> Identity:
    """The authenticated caller of the RPC this thread is serving. Outside an RPC (or on a
    thread the RPC handed work to) it fails closed with Unauthenticated."""
    try:
        return _IDENTITY.get()
    except LookupError:
        raise Unauthenticated("no authenticated caller on this thread") from None


def peer_certificate(context: grpc.ServicerContext) -> PeerCertificate | None:
    """The client certificate the TLS handshake verified, if any."""
    auth = context.auth_context()
    common = auth.get("x509_common_name") or []
    alt = auth.get("x509_subject_alternative_name") or []
    if not common and not alt:
        return None
    return PeerCertificate(common[0].decode(errors="replace") if common else "",
                           tuple(a.decode(errors="replace") for a in alt))


class AuthInterceptor(grpc.ServerInterceptor):
    """Authenticates every call with ``authenticator``; ``rejected(method, code)`` counts the
    calls it refuses (the services' error counter)."""

    def __init__(self, authenticator: Authenticator, rejected: Callable[[str, str], None] | None = None) -> None:
        self.authenticator = authenticator
        self._rejected = rejected

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.request_streaming and handler.response_streaming:
            return handler._replace(stream_stream=self._streaming(handler.stream_stream, method, checked_requests=True))
        if handler.request_streaming:
            return handler._replace(stream_unary=self._unary(handler.stream_unary, method, checked_requests=True))
        # A unary request is served as a request stream of one: grpcio reads a unary request before
        # the handler runs, and gRPC refuses one over max_receive_message_length then, with
        # RESOURCE_EXHAUSTED, to a caller not yet authenticated (DESIGN §11: authentication first).
        if handler.response_streaming:
            return handler._replace(request_streaming=True, unary_stream=None, stream_stream=self._streaming(
                _one_request(handler.unary_stream, method), method, checked_requests=False))
        return handler._replace(request_streaming=True, unary_unary=None, stream_unary=self._unary(
            _one_request(handler.unary_unary, method), method, checked_requests=False))

    def _start(self, context: grpc.ServicerContext, method: str) -> _Call:
        """Authenticates the call, or aborts it (the handler never runs)."""
        authorization = [str(v) for k, v in context.invocation_metadata() if k == "authorization"]
        certificate = peer_certificate(context) if self.authenticator.trust_certs else None
        try:
            return _Call(self.authenticator, authorization, certificate)
        except Unauthenticated as exc:
            self._refuse(context, method, grpc.StatusCode.UNAUTHENTICATED, f"{method}: {exc}")
        except (OSError, TierUnavailable) as exc:  # the tenant's salt could not be stored (its file; etcd in a cluster)
            logger.error("%s: cannot authenticate: %s", method, exc)
            self._refuse(context, method, grpc.StatusCode.UNAVAILABLE, f"{method}: cannot get the tenant's salt: {exc}")
        raise AssertionError("context.abort returned")

    def _refuse(self, context: grpc.ServicerContext, method: str, code: grpc.StatusCode, message: str) -> None:
        logger.debug("refused %s from %s: %s", method, context.peer(), message)
        if self._rejected is not None:
            self._rejected(method, code.name)
        context.abort(code, message)

    def _unary(self, behaviour: Callable[[Any, grpc.ServicerContext], Any], method: str, *,
               checked_requests: bool) -> Callable[..., Any]:
        def authenticated(request: Any, context: grpc.ServicerContext) -> Any:
            call = self._start(context, method)
            return call.run(behaviour, call.checked(request) if checked_requests else request, context)

        return authenticated

    def _streaming(self, behaviour: Callable[[Any, grpc.ServicerContext], Iterator[Any]], method: str, *,
                   checked_requests: bool) -> Callable[..., Any]:
        def authenticated(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            call = self._start(context, method)  # before the handler runs: a refused caller takes no stream slot
            produced = iter(call.run(behaviour, call.checked(request) if checked_requests else request, context))
            try:
                while True:
                    try:
                        response = call.run(next, produced)
                    except StopIteration:
                        return
                    try:
                        call.recheck()
                    except Unauthenticated as exc:
                        self._refuse(context, method, grpc.StatusCode.UNAUTHENTICATED, f"{method}: {exc}")
                    yield response
            finally:
                close = getattr(produced, "close", None)
                if close is not None:
                    call.run(close)

        return authenticated


def _one_request(behaviour: Callable[[Any, grpc.ServicerContext], Any], method: str) -> Callable[..., Any]:
    """``behaviour`` of a unary request, called with a request stream: its one message is read
    only now, once the caller is authenticated (none: UNIMPLEMENTED, as grpcio answers)."""
    def one(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        for request in requests:
            return behaviour(request, context)
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} requires exactly one request message")
        raise AssertionError("context.abort returned")

    return one


class _Call:
    """One authenticated call.

    Every step of its handler runs in a copy of the thread's context holding the identity, so
    the identity is never set in the thread's own context (nothing to reset, nothing left for
    the next call, also when a stream is closed from another thread). A stream re-checks its
    caller on each message once the auth file was reloaded or the credential's expiry passed,
    so that a token revoked (SIGHUP) or expired while a stream is open ends the stream.
    """

    def __init__(self, authenticator: Authenticator, authorization: list[str], certificate: PeerCertificate | None) -> None:
        self._authenticator = authenticator
        self._authorization = authorization
        self._certificate = certificate
        self._generation = authenticator.generation
        self.identity = authenticator.authenticate(authorization, certificate)
        self._context = contextvars.copy_context()
        self._context.run(_IDENTITY.set, self.identity)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._context.run(fn, *args)

    def recheck(self) -> None:
        """Raises Unauthenticated when the caller's credential no longer grants what it did."""
        expires = self.identity.expires_unix_s
        if self._generation == self._authenticator.generation and (expires is None or time.time() < expires):
            return
        generation = self._authenticator.generation
        try:
            now = self._authenticator.authenticate(self._authorization, self._certificate)
        except Unauthenticated as exc:
            raise Unauthenticated(f"the credential stopped working while the stream was open ({exc})") from None
        if now != self.identity:
            raise Unauthenticated("the credential now grants another tenant or other rights; call again")
        self.identity, self._generation = now, generation  # same grant, maybe a new expiry

    def checked(self, requests: Iterator[Any]) -> Iterator[Any]:
        """The request stream, re-checking the caller before each message (the services map
        the Unauthenticated it may raise to UNAUTHENTICATED)."""
        for request in requests:
            self.recheck()
            yield request


# The same-host call channel (kvstore/callsocket/socket_server.py) authenticates its
# connections and re-checks their caller with this very class.
AuthenticatedCall = _Call
