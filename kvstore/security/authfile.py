"""The --auth-file: who may call, as which tenant, with which rights, until when.

More: kvstore/security/README.md (### authfile.py).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import re
import secrets
import stat
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config import QUOTA_BYTES_FIELDS, TenantQuota, parse_size
from kvstore.errors import ConfigError
from kvstore.security.identity import Rights, check_tenant_name

logger = logging.getLogger(__name__)

_TOKEN = re.compile(r"^[\x21-\x7e]{16,4096}$")  # printable ASCII, no spaces: it travels in an HTTP/2 header
_HEX_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")
_TOKEN_KEYS = {"tenant", "rights", "token", "sha256", "expires", "comment"}
_CERT_KEYS = {"tenant", "rights", "subject", "expires", "comment"}


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def new_token() -> str:
    """A random bearer token: 256 bits, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def token_entry(tenant: str, rights: Rights, token: str) -> str:
    """The TOML entry that grants ``token``, holding only its digest."""
    names = ", ".join(f'"{n}"' for n in rights.names())
    return f'[[tokens]]\ntenant = "{tenant}"\nrights = [{names}]\nsha256 = "{token_digest(token).hex()}"\n'


@dataclass(frozen=True)
class Grant:
    """What one entry of the file grants: a tenant and rights, until ``expires_unix_s``."""

    tenant: str
    rights: Rights
    expires_unix_s: float | None = None  # None: never

    def expired(self, now_unix_s: float) -> bool:
        return self.expires_unix_s is not None and now_unix_s >= self.expires_unix_s


@dataclass(frozen=True)
class AuthTable:
    """One version of the auth file, parsed. Immutable: a reload builds a new one."""

    tokens: dict[bytes, Grant] = field(default_factory=dict)  # SHA-256 of the token -> grant
    certs: dict[str, Grant] = field(default_factory=dict)  # certificate name (CN or SAN) -> grant
    quotas: dict[str, dict[str, int]] = field(default_factory=dict)  # tenant -> its own TenantQuota fields

    def tenants(self) -> set[str]:
        return {g.tenant for g in (*self.tokens.values(), *self.certs.values())}

    def find_token(self, token: str) -> Grant | None:
        """The grant of ``token``; only its digest is compared (see the module docstring)."""
        return self.tokens.get(token_digest(token))

    def find_cert(self, names: Iterable[str]) -> list[Grant]:
        """The grants of every entry naming one of ``names`` (a certificate's CN and SANs)."""
        found: list[Grant] = []
        for name in names:
            grant = self.certs.get(name)
            if grant is not None and grant not in found:
                found.append(grant)
        return found


def load(path: Path) -> AuthTable:
    """Reads and checks the whole file; any problem is a ConfigError naming the entry."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--auth-file {path}: cannot read: {exc.strerror or exc}") from None
    try:
        doc = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ConfigError(f"--auth-file {path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}") from None
    table = parse(doc, f"--auth-file {path}")
    if table.tokens and _holds_plain_tokens(doc) and stat.S_IMODE(path.stat().st_mode) & 0o077:
        logger.warning("--auth-file %s holds tokens in clear text and other users can read it: chmod 600 it, "
                       "or store sha256 = ... instead of token = ...", path)
    return table


def _holds_plain_tokens(doc: dict[str, Any]) -> bool:
    return any(isinstance(e, dict) and "token" in e for e in doc.get("tokens", ()))


def parse(doc: object, where: str) -> AuthTable:
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: the top level must be a table with 'tokens' and/or 'certs'")
    unknown = set(doc) - {"tokens", "certs", "quotas"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; expected 'tokens', 'certs' and/or 'quotas'")
    tokens: dict[bytes, Grant] = {}
    for i, entry in enumerate(_entries(doc, "tokens", where)):
        at = f"{where}: tokens[{i}]"
        digest = _digest(_keys(entry, _TOKEN_KEYS, at), at)
        if digest in tokens:
            raise ConfigError(f"{at}: the same token appears twice")
        tokens[digest] = _grant(entry, at)
    certs: dict[str, Grant] = {}
    for i, entry in enumerate(_entries(doc, "certs", where)):
        at = f"{where}: certs[{i}]"
        subject = _keys(entry, _CERT_KEYS, at).get("subject")
        if not isinstance(subject, str) or not subject:
            raise ConfigError(f"{at}: subject (a client certificate's common name or SAN) is required")
        if subject in certs:
            raise ConfigError(f"{at}: subject {subject!r} appears twice")
        certs[subject] = _grant(entry, at)
    return AuthTable(tokens, certs, _quotas(doc.get("quotas", {}), where))


def _quotas(table: object, where: str) -> dict[str, dict[str, int]]:
    """``{tenant: {field: value}}``, each value checked as TenantQuota checks it."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: 'quotas' must be a table of tenants ([quotas.TENANT] in TOML)")
    fields = set(vars(TenantQuota()))
    quotas: dict[str, dict[str, int]] = {}
    for tenant, entry in table.items():
        at = f"{where}: quotas.{tenant}"
        check_tenant_name(tenant, at)
        values = {}
        for name, value in _keys(entry, fields, at).items():
            if name in QUOTA_BYTES_FIELDS and isinstance(value, str):
                value = parse_size(value, f"{at}.{name}")
            values[name] = value
        try:
            TenantQuota(**values)
        except ConfigError as exc:
            raise ConfigError(f"{at}: {exc}") from None
        quotas[tenant] = values
    return quotas


def _entries(doc: dict[str, Any], key: str, where: str) -> list[Any]:
    entries = doc.get(key, [])
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: '{key}' must be a list of tables ([[{key}]] in TOML)")
    return entries


def _keys(entry: object, allowed: set[str], at: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise ConfigError(f"{at}: must be a table")
    unknown = set(entry) - allowed
    if unknown:  # a misspelt 'expires' must not silently make a token eternal
        raise ConfigError(f"{at}: unknown key(s) {sorted(unknown)}; allowed: {', '.join(sorted(allowed))}")
    return entry


def _digest(entry: dict[str, Any], at: str) -> bytes:
    if ("token" in entry) == ("sha256" in entry):
        raise ConfigError(f"{at}: give exactly one of token (the token) and sha256 (its SHA-256, hex)")
    if "token" in entry:
        token = entry["token"]
        if not isinstance(token, str) or not _TOKEN.fullmatch(token):
            raise ConfigError(f"{at}: token must be 16-4096 printable ASCII characters without spaces")
        return token_digest(token)
    digest = entry["sha256"]
    if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest):
        raise ConfigError(f"{at}: sha256 must be 64 hex digits (sha256sum of the token, without a newline)")
    return bytes.fromhex(digest)


def _grant(entry: dict[str, Any], at: str) -> Grant:
    tenant = check_tenant_name(entry.get("tenant"), at)
    rights = entry.get("rights")
    if not isinstance(rights, list):
        raise ConfigError(f"{at}: rights must be a list, e.g. [\"read\", \"write\"]")
    return Grant(tenant, Rights.parse(rights, at), _expires(entry.get("expires"), at))


def _expires(value: object, at: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{at}: expires must be a time, not {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            value = datetime.datetime.fromisoformat(value)
        except ValueError:
            raise ConfigError(f"{at}: expires {value!r} is not an RFC 3339 time (e.g. 2030-01-01T00:00:00Z)") from None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            raise ConfigError(f"{at}: expires {value} has no UTC offset; write e.g. 2030-01-01T00:00:00Z")
        return value.timestamp()
    raise ConfigError(f"{at}: expires must be a date-time with offset or unix seconds, got {value!r}")
