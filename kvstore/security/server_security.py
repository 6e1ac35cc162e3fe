"""What the server process takes from kvstore.security: the interceptor that authenticates
every call, the port (TLS or not) and the reload of the auth file on SIGHUP."""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable
from pathlib import Path

import grpc

from kvstore.config import SecurityConfig
from kvstore.errors import ConfigError
from kvstore.security.authenticator import Authenticator
from kvstore.security.interceptor import AuthInterceptor
from kvstore.security.salts import TenantSalts

logger = logging.getLogger(__name__)


def _read(flag: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None


def server_credentials(config: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from --tls-cert/--tls-key, requiring client certificates signed by
    --tls-client-ca when one is given (mTLS); None without TLS. The files are checked with
    the ssl module first: gRPC's own answer to a bad file is "Failed to bind to address"."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        check.load_cert_chain(config.tls_cert, config.tls_key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"--tls-cert {config.tls_cert} / --tls-key {config.tls_key}: not a PEM certificate and "
                          f"its private key ({exc})") from None
    client_ca = None
    if config.tls_client_ca is not None:
        try:
            check.load_verify_locations(cafile=config.tls_client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"--tls-client-ca {config.tls_client_ca}: not a PEM CA certificate ({exc})") from None
        client_ca = _read("--tls-client-ca", config.tls_client_ca)
    return grpc.ssl_server_credentials(
        [(_read("--tls-key", config.tls_key), _read("--tls-cert", config.tls_cert))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


class ServerSecurity:
    """Built once per server from its SecurityConfig. ``interceptor`` goes into
    ``grpc.server(interceptors=...)``, ``add_port`` replaces ``add_insecure_port``,
    ``reload`` is what SIGHUP calls. ``rejected(method, code)`` counts refused calls."""

    def __init__(self, config: SecurityConfig, data_dir: Path, rejected: Callable[[str, str], None] | None = None,
                 salts: Callable[[], TenantSalts] | None = None) -> None:
        """``salts``: where the tenants' salts come from when there are tenants (cluster mode:
        etcd, shared by the nodes); by default ``DATA_DIR/tenant-salts.json``."""
        self.config = config
        trust_certs = config.tls_client_ca is not None
        tenants = config.auth_file is not None or trust_certs
        self.salts = (salts or (lambda: TenantSalts(data_dir)))() if tenants else None
        self.authenticator = Authenticator(config.auth_file, self.salts, trust_certs=trust_certs)
        self.interceptor = AuthInterceptor(self.authenticator, rejected)
        self._credentials = server_credentials(config)

    @property
    def tls(self) -> bool:
        return self._credentials is not None

    def add_port(self, server: grpc.Server, listen: str) -> int:
        """Binds ``listen``; returns the port (0: could not bind)."""
        if self._credentials is None:
            return server.add_insecure_port(listen)
        try:
            return server.add_secure_port(listen, self._credentials)
        except RuntimeError:  # grpcio raises, where add_insecure_port answers 0
            return 0

    def add_local(self, server: grpc.Server, path: Path) -> None:
        """Binds the Unix socket ``path`` without TLS (same-host callers: nothing on it crosses a
        network; the file's mode 0600 keeps other uids out); every call on it is authenticated as
        on the TCP port. A socket file left by a dead server is replaced."""
        if path.is_socket():
            path.unlink()  # this server holds the data directory's lock: no live server uses it
        elif path.exists():
            raise ConfigError(f"--local-socket {path}: exists and is not a socket")
        old = os.umask(0o177)  # the socket is created 0600: no window in which others may connect
        try:
            bound = server.add_insecure_port(f"unix:{path}")
        finally:
            os.umask(old)
        if bound == 0 or not path.is_socket():
            raise ConfigError(f"--local-socket {path}: cannot bind")
        os.chmod(path, 0o600)

    def describe(self) -> str:
        """One phrase for the start-up log line."""
        tls = ("mTLS" if self.authenticator.trust_certs else "TLS") if self.tls else "no TLS"
        if self.config.auth_file is not None:
            return f"{tls}, tokens from {self.config.auth_file}"
        return f"{tls}, {'client certificates name the tenant' if self.authenticator.trust_certs else 'no authentication'}"

    def reload(self) -> bool:
        return self.authenticator.reload()
