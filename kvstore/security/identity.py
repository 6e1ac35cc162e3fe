"""Who is calling: a tenant, the rights it was granted, and its server-assigned salt."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvstore.errors import ConfigError

LOCAL_TENANT = "local"  # every caller, when the server runs without --auth-file
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$")


class Rights(enum.IntFlag):
    """What a caller may do with the namespaces its tenant owns. ``ADMIN`` is separate from
    ``READ`` and ``WRITE``: it is the right to act on other tenants' namespaces and on the
    server (invalidate, purge, session deletion, unfiltered stats), not a superset of data
    access; grant all three to an operator's token. ``NODE`` is a cluster node's right (DESIGN
    §12): publishing and withdrawing location records, asking a shard owner (``local_only``),
    reading and replicating for the tenant a request names. Give it only to the nodes'
    certificates (or the cluster token), never to a tenant: it reaches every namespace."""

    NONE = 0
    READ = 1
    WRITE = 2
    ADMIN = 4
    NODE = 8

    @classmethod
    def parse(cls, names: Iterable[object], where: str) -> Rights:
        """``["read", "write"]`` -> READ|WRITE; anything else is a ConfigError naming ``where``."""
        rights = cls.NONE
        for name in names:
            if not isinstance(name, str) or name.lower() not in ("read", "write", "admin", "node"):
                raise ConfigError(f"{where}: unknown right {name!r}; use read, write, admin, node")
            rights |= cls[name.upper()]
        if rights == cls.NONE:
            raise ConfigError(f"{where}: rights must name at least one of read, write, admin, node")
        return rights

    def names(self) -> list[str]:
        return [r.name.lower() for r in self if r.name]


ALL_RIGHTS = Rights.READ | Rights.WRITE | Rights.ADMIN


def check_tenant_name(name: object, where: str) -> str:
    """Tenant names are 1-128 characters of letters, digits and ``._@:-``: they appear in
    logs, metrics labels and the salt file, so nothing that could forge a line or a label."""
    if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
        raise ConfigError(f"{where}: tenant must be 1-128 characters of letters, digits and ._@:- "
                          f"(starting with a letter or digit), got {name!r}")
    return name


@dataclass(frozen=True)
class Identity:
    """The authenticated caller of one RPC.

    ``salt`` is the tenant's secret, server-assigned salt (empty for the local tenant of a
    server without --auth-file, so that its namespace ids are those of before tenants).
    ``via`` says how the caller proved it: "token", "cert" or "local";
    ``expires_unix_s`` when its credential stops working (None: never).
    """

    tenant: str
    rights: Rights
    salt: bytes = field(repr=False)
    via: str = "token"
    expires_unix_s: float | None = field(default=None, compare=False)

    def allows(self, right: Rights) -> bool:
        return right in self.rights
