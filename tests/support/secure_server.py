"""Shared by the security tests: auth files, secured server configs, and a call of every RPC
the protos declare (found from the descriptors, so a new RPC is covered without a test edit)."""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

import kvstore._proto
from kvstore.config import SecurityConfig, ServerConfig
from support.certs import CertAuthority, Issued
from support.servers import make_config

ALICE = "alice-token-0123456789abcdef"  # read, write
BOB = "bob-token-0123456789abcdef01"  # read, write
ADMIN = "admin-token-0123456789abcdef"  # read, write, admin
EXPIRED = "expired-token-0123456789abcd"  # alice's, expired in 1970
PAST_S = 1.0


def grants() -> list[dict[str, Any]]:
    return [
        {"tenant": "alice", "rights": ["read", "write"], "token": ALICE},
        {"tenant": "bob", "rights": ["read", "write"], "token": BOB},
        {"tenant": "ops", "rights": ["read", "write", "admin"], "token": ADMIN},
        {"tenant": "alice", "rights": ["read", "write"], "token": EXPIRED, "expires": PAST_S},
    ]


def write_auth_file(path: Path, tokens: list[dict[str, Any]], certs: list[dict[str, Any]] | None = None) -> Path:
    """A JSON auth file (the TOML form is tested in test_authfile.py)."""
    path.write_text(json.dumps({"tokens": tokens, "certs": certs or []}))
    path.chmod(0o600)
    return path


def secure_config(tmp: Path, *, auth_file: Path | None = None, tls: Issued | None = None, client_ca: CertAuthority | None = None,
                  **kw: object) -> ServerConfig:
    security = SecurityConfig(auth_file=auth_file, tls_cert=tls.cert if tls else None, tls_key=tls.key if tls else None,
                              tls_client_ca=client_ca.cert if client_ca else None)
    return make_config(tmp, security=security, **kw)


def every_method() -> Iterator[tuple[ServiceDescriptor, MethodDescriptor]]:
    """Every RPC of every service in kvstore/_proto."""
    for info in pkgutil.iter_modules(kvstore._proto.__path__):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(f"kvstore._proto.{info.name}")
            for service in module.DESCRIPTOR.services_by_name.values():
                yield from ((service, method) for method in service.methods)


def call_raw(channel: grpc.Channel, service: ServiceDescriptor, method: MethodDescriptor, token: str | None = None,
             timeout_s: float = 10.0, *, body: bytes = b"", metadata: list[tuple[str, str]] | None = None) -> grpc.StatusCode:
    """Calls ``method`` with ``body`` as its request (raw bytes; empty by default: what a request
    says does not matter to authentication) and returns the status it ended with. ``metadata``
    is sent as given, in place of the bearer ``token``'s."""
    path = f"/{service.full_name}/{method.name}"
    if metadata is None and token is not None:
        metadata = [("authorization", f"Bearer {token}")]
    try:
        if method.client_streaming and method.server_streaming:
            list(channel.stream_stream(path)(iter([body]), timeout=timeout_s, metadata=metadata))
        elif method.client_streaming:
            channel.stream_unary(path)(iter([body]), timeout=timeout_s, metadata=metadata)
        elif method.server_streaming:
            list(channel.unary_stream(path)(body, timeout=timeout_s, metadata=metadata))
        else:
            channel.unary_unary(path)(body, timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def tls_channel(address: str, ca: CertAuthority, client: Issued | None = None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(ca.cert.read_bytes(), client.key.read_bytes() if client else None,
                                               client.cert.read_bytes() if client else None)
    return grpc.secure_channel(address, credentials)
