"""Benchmark servers with security on: a throw-away CA and server certificate, an auth file
naming each tenant's tokens, the server flags and the client's ``ClientTLS`` that go with them.

Certificates are made here with the ``cryptography`` package (the bench and test extras), or
taken from ``--tls-dir`` (``ca.pem``, ``server.crt``, ``server.key``; the server certificate
must name 127.0.0.1). Tokens are fresh random ones; the auth file holds only their SHA-256
(kvstore.security.authfile), one entry per token, so every token is its own credential.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.security.authfile import new_token, token_entry
from kvstore.security.channel import ClientTLS
from kvstore.security.identity import Rights

ADMIN_TENANT = "ops"


@dataclass(frozen=True)
class Credentials:
    """What a secured benchmark server and its clients need. ``tokens``: tenant -> its
    tokens (read + write); ``admin``: a token of tenant ``ops`` with every right."""

    ca: Path
    cert: Path
    key: Path
    auth_file: Path
    tokens: dict[str, list[str]]
    admin: str

    def server_args(self) -> tuple[str, ...]:
        return ("--auth-file", str(self.auth_file), "--tls-cert", str(self.cert), "--tls-key", str(self.key))

    def tls(self) -> ClientTLS:
        return ClientTLS(ca=self.ca)


def make_credentials(directory: Path, tenants: dict[str, int], tls_dir: Path | None = None) -> Credentials:
    """Tokens for ``tenants`` (name -> how many tokens), an admin token, the auth file, and
    TLS files: from ``tls_dir`` if given, else a fresh CA and server certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    if tls_dir is not None:
        ca, cert, key = tls_dir / "ca.pem", tls_dir / "server.crt", tls_dir / "server.key"
        for path in (ca, cert, key):
            if not path.is_file():
                raise ConfigError(f"--tls-dir {tls_dir}: {path.name} is missing (ca.pem, server.crt, server.key)")
    else:
        ca, cert, key = _issue_server_certificate(directory)
    tokens = {tenant: [new_token() for _ in range(count)] for tenant, count in tenants.items()}
    admin = new_token()
    entries = [token_entry(tenant, Rights.READ | Rights.WRITE, t) for tenant, ts in tokens.items() for t in ts]
    entries.append(token_entry(ADMIN_TENANT, Rights.READ | Rights.WRITE | Rights.ADMIN, admin))
    auth_file = directory / "tokens.toml"
    auth_file.write_text("\n".join(entries))
    auth_file.chmod(0o600)
    return Credentials(ca=ca, cert=cert, key=key, auth_file=auth_file, tokens=tokens, admin=admin)


def _issue_server_certificate(directory: Path) -> tuple[Path, Path, Path]:
    """A one-day CA and a server certificate for 127.0.0.1/localhost signed by it (PEM files)."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise ConfigError("making TLS certificates needs the 'cryptography' package (pip install 'kvstore[bench]'), "
                          "or give --tls-dir with ca.pem, server.crt, server.key") from None
    now = datetime.datetime.now(datetime.UTC)
    valid = {"not_valid_before": now - datetime.timedelta(minutes=5), "not_valid_after": now + datetime.timedelta(days=1)}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore-bench CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(valid["not_valid_before"])
        .not_valid_after(valid["not_valid_after"])
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore-bench server")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = directory / "ca.pem", directory / "server.crt", directory / "server.key"
    paths[0].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    paths[2].chmod(0o600)
    return paths
