"""Who can reach the server: loopback or not, and the refusal to expose an unprotected
server to the network unless --insecure says so (Redis's "protected mode").

No gRPC and no config imports here: kvstore/config.py calls ``check_exposure`` from
ServerConfig's validation, and the client's channel code asks ``is_local_address``.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvstore.config import SecurityConfig


def split_host(address: str) -> str:
    """The host of ``HOST:PORT`` / ``[v6]:PORT`` (the whole text when there is no port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        host = address
    return host.strip("[]")


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 and "localhost"; a wildcard (0.0.0.0, ::, empty) or any other name is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def is_local_address(address: str) -> bool:
    """Whether only processes of this host can reach ``address`` (a gRPC target or listen address)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    if address.startswith(("ipv4:", "ipv6:", "dns:")):
        address = address.split(":", 1)[1].lstrip("/")
    return is_loopback_host(split_host(address))


def check_exposure(listen: str, metrics_listen: str | None, security: SecurityConfig) -> None:
    """Raises ConfigError when a non-loopback address would serve without protection and
    --insecure was not given. gRPC off loopback needs TLS (tokens must not cross the network
    in clear text) and authentication (an auth file or client certificates): without them
    anyone who reaches the port reads, overwrites and deletes every tenant's pages. /metrics
    has no authentication at all, so off loopback it always needs --insecure."""
    if security.insecure:
        return
    if not is_local_address(listen):
        if security.tls_cert is None:
            raise ConfigError(f"--listen {listen} is not a loopback address and the server has no TLS: give --tls-cert and "
                              "--tls-key (with --auth-file or --tls-client-ca), or --insecure to serve in clear text anyway")
        if security.auth_file is None and security.tls_client_ca is None:
            raise ConfigError(f"--listen {listen} is not a loopback address and no caller would be authenticated (every "
                              "one could read, overwrite and delete every tenant's pages): give --auth-file or "
                              "--tls-client-ca, or --insecure to serve anyone anyway")
    if metrics_listen is not None and not is_local_address(metrics_listen):
        raise ConfigError(f"--metrics-listen {metrics_listen} is not a loopback address and /metrics has no authentication: "
                          "keep it on 127.0.0.1 (scrape through a proxy), or give --insecure to expose it anyway")
