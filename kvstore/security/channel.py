"""The client's side: channels that present a bearer token and/or speak TLS.

A leaf module (gRPC, kvstore.errors, kvstore.security.exposure): the client's channel
creation calls ``aio_channel``/``sync_channel`` instead of ``grpc.*insecure_channel``.

How the token travels: as gRPC call credentials (``authorization: Bearer <token>`` on every
call), which gRPC sends only over a channel that protects them. With ``tls`` that is TLS;
without, gRPC's *local* credentials, which connect only to a peer on this host (loopback
TCP or a Unix socket) and then interoperate with the server's plain port. So a token never
crosses the network in clear text: to a non-loopback address without ``tls`` it is refused
here, before anything is sent.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvstore.errors import ConfigError
from kvstore.security.exposure import is_local_address

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


def channel_credentials(address: str, token: str | None, tls: ClientTLS | None) -> grpc.ChannelCredentials | None:
    """The credentials of a channel to ``address``; None means a plain channel (no token,
    no TLS: what a server without --auth-file on loopback expects)."""
    call = None
    if token is not None:
        if not _TOKEN.match(token):
            raise ConfigError("token must be printable ASCII without spaces (it is sent as 'authorization: Bearer <token>')")
        call = grpc.access_token_call_credentials(token)
    if tls is not None:
        channel = tls.credentials()
    elif call is not None:
        if not is_local_address(address):
            raise ConfigError(f"{address} is not a loopback address: a token is sent to it only over TLS (give tls=/--tls-ca)")
        local = grpc.LocalConnectionType.UDS if address.startswith("unix") else grpc.LocalConnectionType.LOCAL_TCP
        channel = grpc.local_channel_credentials(local)
    else:
        return None
    return channel if call is None else grpc.composite_channel_credentials(channel, call)


def channel_options(options: Sequence[tuple[str, Any]], tls: ClientTLS | None) -> list[tuple[str, Any]]:
    if tls is not None and tls.server_name:
        return [*options, ("grpc.ssl_target_name_override", tls.server_name)]
    return list(options)


def aio_channel(address: str, options: Sequence[tuple[str, Any]] = (), *, token: str | None = None,
                tls: ClientTLS | None = None) -> grpc.aio.Channel:
    """An asyncio channel to ``address`` presenting ``token`` and/or speaking ``tls``."""
    credentials = channel_credentials(address, token, tls)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, credentials, options=channel_options(options, tls))


def sync_channel(address: str, options: Sequence[tuple[str, Any]] = (), *, token: str | None = None,
                 tls: ClientTLS | None = None) -> grpc.Channel:
    """A blocking channel to ``address``, as ``aio_channel``."""
    credentials = channel_credentials(address, token, tls)
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials, options=channel_options(options, tls))
