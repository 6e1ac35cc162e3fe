"""The client's side: channels that present a bearer token and/or speak TLS.

A leaf module (gRPC, kvstore.errors, kvstore.security.exposure and .loopback_owner): the
client's channel creation calls ``aio_channel``/``sync_channel`` instead of
``grpc.*insecure_channel``.

More: kvstore/security/README.md (### channel.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from kvstore.errors import ConfigError
from kvstore.security.exposure import is_local_address
from kvstore.security.loopback_owner import LoopbackOwner, TokenWithheld, loopback_port

_TOKEN = re.compile(r"^[\x21-\x7e]+$")  # an HTTP/2 header value: printable ASCII, no spaces


@dataclass(frozen=True)
class ClientTLS:
    """TLS for a client's channel.

    ``ca``: PEM of the CA(s) that signed the server's certificate (None: the system's
    roots). ``cert``/``key``: the client's certificate and key, for a server with
    --tls-client-ca (mTLS; the certificate names the tenant). ``server_name``: the name to
    check in the server's certificate when it differs from the address's host.
    """

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("tls: a client certificate (--tls-cert) and its key (--tls-key) go together")
        for name in ("ca", "cert", "key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read("tls ca", self.ca),
            private_key=_read("tls key", self.key),
            certificate_chain=_read("tls cert", self.cert),
        )


def _read(what: str, path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read: {exc.strerror or exc}") from None


def check_token_route(address: str, token: str | None, tls: ClientTLS | None) -> None:
    """Raises ConfigError for a token that is malformed or would cross the network in clear text."""
    if token is None:
        return
    if not _TOKEN.fullmatch(token):
        raise ConfigError("token must be printable ASCII without spaces (it is sent as 'authorization: Bearer <token>')")
    _check_clear_route(address, tls)


def _check_clear_route(address: str, tls: ClientTLS | None) -> None:
    if tls is None and not is_local_address(address):
        raise ConfigError(f"{address} is not a loopback address: a token is sent to it only over TLS (give tls=/--tls-ca)")


def owner_check(address: str, tls: ClientTLS | None) -> LoopbackOwner | None:
    """The check a token needs before it goes to ``address`` in clear text (None: over TLS, or
    to a Unix socket, whose 0600 mode keeps other uids out)."""
    port = loopback_port(address) if tls is None else None
    return LoopbackOwner(address, port) if port is not None else None


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that authenticates one call (empty without a token)."""
    return (("authorization", f"Bearer {token}"),) if token is not None else ()


def channel_options(options: Sequence[tuple[str, Any]], tls: ClientTLS | None) -> list[tuple[str, Any]]:
    if tls is not None and tls.server_name:
        return [*options, ("grpc.ssl_target_name_override", tls.server_name)]
    return list(options)


def aio_channel(address: str, options: Sequence[tuple[str, Any]] = (), *, token: str | None = None,
                tls: ClientTLS | None = None, per_call_tokens: bool = False) -> grpc.aio.Channel:
    """An asyncio channel to ``address`` whose every call presents ``token``, over ``tls`` if given.
    ``per_call_tokens``: the caller adds tokens to calls itself (``call_metadata``, kvstore-bench
    fuzz); a call that carries one is checked as the channel's own token would be."""
    check_token_route(address, token, tls)
    if per_call_tokens:
        _check_clear_route(address, tls)
    owner = owner_check(address, tls)
    guarded = token is not None or (per_call_tokens and owner is not None)
    interceptors = aio_token_interceptors(token, owner) if guarded else None
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.credentials(), options=channel_options(options, tls), interceptors=interceptors)


def sync_channel(address: str, options: Sequence[tuple[str, Any]] = (), *, token: str | None = None,
                 tls: ClientTLS | None = None) -> grpc.Channel:
    """A blocking channel to ``address``, as ``aio_channel``."""
    check_token_route(address, token, tls)
    if tls is None:
        channel = grpc.insecure_channel(address, options=list(options))
    else:
        channel = grpc.secure_channel(address, tls.credentials(), options=channel_options(options, tls))
    return grpc.intercept_channel(channel, SyncBearerToken(token, owner_check(address, tls))) if token is not None else channel


def _with_token(metadata: Any, header: tuple[tuple[str, str], ...], owner: LoopbackOwner | None) -> tuple[tuple[str, str], ...]:
    """A call's metadata with the channel's token (if any) added, once ``owner`` (if any) let a
    token go; raises the call's UNAUTHENTICATED error if it does not."""
    metadata = (*(tuple(item) for item in metadata or ()), *header)
    if owner is not None and any(key == "authorization" for key, _ in metadata):
        try:
            owner.check()
        except TokenWithheld as exc:
            # AioRpcError is also the grpc.RpcError a blocking channel's caller catches.
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details=str(exc)) from None
    return metadata


class _AioToken:
    """Adds the bearer token (if any) to the calls of an asyncio channel, once ``owner`` let it
    go. grpc.aio files each interceptor under the first call kind it implements, so there is one
    class per kind."""

    def __init__(self, token: str | None, owner: LoopbackOwner | None) -> None:
        self._header = call_metadata(token)
        self._owner = owner

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=grpc.aio.Metadata(*_with_token(details.metadata, self._header, self._owner)))


class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _AioStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


def aio_token_interceptors(token: str | None, owner: LoopbackOwner | None = None) -> list[Any]:
    """The interceptors that make every call of a grpc.aio channel present ``token``, each call
    with a token only once ``owner`` let it go."""
    return [kind(token, owner) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class SyncBearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                      grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every call of a blocking channel (``grpc.intercept_channel``),
    once ``owner`` let it go."""

    def __init__(self, token: str, owner: LoopbackOwner | None = None) -> None:
        self._header = call_metadata(token)
        self._owner = owner

    def _details(self, details: Any) -> Any:
        return _CallDetails(details.method, details.timeout, _with_token(details.metadata, self._header, self._owner),
                            details.credentials, getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)
