"""Certificates made in the test, with the ``cryptography`` package: a CA, a server
certificate for 127.0.0.1/localhost, client certificates naming a tenant. Nothing is
read from the host's trust store."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


class CertAuthority:
    """A throw-away CA that writes PEM files into ``directory``."""

    def __init__(self, directory: Path, name: str = "kvstore test CA") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(self._key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = directory / f"{name.replace(' ', '-')}.pem"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, common_name: str, *, dns: tuple[str, ...] = (), ips: tuple[str, ...] = (), server: bool = False,
              days: float = 1.0, client: bool = False) -> Issued:
        """A leaf certificate for ``common_name`` with the given SANs (server or client use;
        ``server`` and ``client``: both, as a cluster node's, which serves and calls the others)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH] * server
                                                 + [ExtendedKeyUsageOID.CLIENT_AUTH] * (client or not server)), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        stem = self.directory / common_name.replace(" ", "-")
        issued = Issued(cert=stem.with_suffix(".crt"), key=stem.with_suffix(".key"))
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(_key_pem(key))
        issued.key.chmod(0o600)
        return issued

    def server_cert(self) -> Issued:
        return self.issue("kvstore-server", dns=("localhost",), ips=("127.0.0.1", "::1"), server=True)
