"""Turns what a call presents (a bearer token, a verified client certificate) into an
Identity, against the current --auth-file; reloadable. No gRPC here: the interceptor
(interceptor.py) extracts the credentials and maps the errors.

More: kvstore/security/README.md (### authenticator.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import ConfigError, Unauthenticated
from kvstore.security import authfile
from kvstore.security.authfile import AuthTable, Grant
from kvstore.security.identity import ALL_RIGHTS, LOCAL_TENANT, Identity, Rights, check_tenant_name
from kvstore.security.salts import TenantSalts

logger = logging.getLogger(__name__)

CERT_RIGHTS_WITHOUT_AUTH_FILE = Rights.READ | Rights.WRITE  # admin is granted only by name, in the auth file
# without auth every caller may do everything, the other nodes of a cluster included
LOCAL_IDENTITY = Identity(LOCAL_TENANT, ALL_RIGHTS | Rights.NODE, b"", via="local")
_NO_QUOTAS: dict[str, dict[str, int]] = {}


@dataclass(frozen=True)
class PeerCertificate:
    """The names of a client certificate the TLS handshake verified against --tls-client-ca."""

    common_name: str
    alt_names: tuple[str, ...] = ()

    def names(self) -> list[str]:
        return [n for n in (self.common_name, *self.alt_names) if n]


class Authenticator:
    """Thread-safe: calls read ``self._table`` once; ``reload`` replaces it whole."""

    def __init__(self, auth_file: Path | None, salts: TenantSalts | None, *, trust_certs: bool = False) -> None:
        if (auth_file is not None or trust_certs) and salts is None:
            raise ValueError("tenants need a salt store")
        self.auth_file = auth_file
        self.trust_certs = trust_certs
        self._salts = salts
        self._table: AuthTable | None = None
        self.generation = 0  # +1 per reload that took effect: open streams re-check their caller then
        if auth_file is not None:
            self._table = authfile.load(auth_file)
            self._assign_salts(self._table)
            logger.info("auth file %s: %d token(s), %d certificate name(s), tenants %s", auth_file,
                        len(self._table.tokens), len(self._table.certs), ", ".join(sorted(self._table.tenants())) or "none")

    @property
    def quotas(self) -> dict[str, dict[str, int]]:
        """The auth file's per-tenant quotas (the same object until a reload replaces it)."""
        table = self._table
        return table.quotas if table is not None else _NO_QUOTAS

    @property
    def required(self) -> bool:
        """Whether a caller must prove who it is (an auth file or mTLS is configured)."""
        return self._table is not None or self.trust_certs

    def _assign_salts(self, table: AuthTable) -> None:
        assert self._salts is not None
        try:
            self._salts.ensure(table.tenants())  # now, so that no RPC has to write the salt file
        except OSError as exc:
            raise ConfigError(f"cannot store the tenants' salts in {self._salts.path}: {exc.strerror or exc}") from None

    def reload(self) -> bool:
        """Reads the auth file again (SIGHUP). A file that does not load keeps the current
        table, and the log says why. Returns whether the new file is in force."""
        if self.auth_file is None:
            logger.info("reload: the server runs without --auth-file, nothing to reload")
            return False
        try:
            table = authfile.load(self.auth_file)
            self._assign_salts(table)
        except ConfigError as exc:
            logger.error("reload refused, the previous auth file stays in force: %s", exc)
            return False
        self._table = table
        self.generation += 1
        logger.info("auth file %s reloaded: %d token(s), %d certificate name(s)", self.auth_file,
                    len(table.tokens), len(table.certs))
        return True

    def authenticate(self, authorization: Sequence[str], certificate: PeerCertificate | None,
                     now_unix_s: float | None = None) -> Identity:
        """The caller's identity; raises Unauthenticated. ``authorization``: the values of the
        call's ``authorization`` headers; ``certificate``: the verified client certificate."""
        table = self._table  # one version of the file for the whole decision
        now = time.time() if now_unix_s is None else now_unix_s
        if authorization and table is not None:
            return self._identity(self._by_token(table, authorization, now), "token")
        if certificate is not None and self.trust_certs:
            if table is None:
                return self._cert_without_auth_file(certificate)
            return self._identity(self._by_certificate(table, certificate, now), "cert")
        if self.required:
            raise Unauthenticated("no credential: send 'authorization: Bearer <token>' metadata"
                                  + (" or a client certificate" if self.trust_certs else ""))
        return LOCAL_IDENTITY

    def _identity(self, grant: Grant, via: str) -> Identity:
        assert self._salts is not None
        return Identity(grant.tenant, grant.rights, self._salts.salt(grant.tenant), via=via, expires_unix_s=grant.expires_unix_s)

    @staticmethod
    def _by_token(table: AuthTable, authorization: Sequence[str], now: float) -> Grant:
        if len(authorization) != 1:
            raise Unauthenticated("more than one authorization header")
        scheme, _, token = authorization[0].partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("the authorization header must be 'Bearer <token>'")
        grant = table.find_token(token.strip())
        if grant is None:
            raise Unauthenticated("unknown token")
        if grant.expired(now):
            raise Unauthenticated(f"token of tenant {grant.tenant!r} expired")
        return grant

    @staticmethod
    def _by_certificate(table: AuthTable, certificate: PeerCertificate, now: float) -> Grant:
        grants = table.find_cert(certificate.names())
        if not grants:
            raise Unauthenticated(f"no --auth-file certs entry names this client certificate (CN={certificate.common_name!r})")
        if len({g.tenant for g in grants}) > 1:
            raise Unauthenticated(f"the client certificate (CN={certificate.common_name!r}) names several tenants")
        valid = [g for g in grants if not g.expired(now)]
        if not valid:
            raise Unauthenticated(f"the certs entry of tenant {grants[0].tenant!r} expired")
        rights = Rights.NONE
        for grant in valid:
            rights |= grant.rights
        ends = [g.expires_unix_s for g in valid if g.expires_unix_s is not None]
        return Grant(valid[0].tenant, rights, max(ends) if len(ends) == len(valid) else None)

    def _cert_without_auth_file(self, certificate: PeerCertificate) -> Identity:
        try:
            tenant = check_tenant_name(certificate.common_name, "client certificate common name")
        except ConfigError as exc:
            raise Unauthenticated(str(exc)) from None
        assert self._salts is not None
        return Identity(tenant, CERT_RIGHTS_WITHOUT_AUTH_FILE, self._salts.salt(tenant), via="cert")
