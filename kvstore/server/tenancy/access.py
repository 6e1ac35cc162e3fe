"""What a caller may do with the namespace a request names (DESIGN §11).

* Read (Lookup, Acquire, ReadPages, Hint, GetSession): the READ right, and the
  caller's tenant owns the namespace or has ADMIN. A namespace the caller may not read
  looks empty to it: the handler answers exactly what it answers for a namespace nothing
  was ever stored in. PERMISSION_DENIED would tell the caller that the id is in use, an
  oracle for "this tenant ran this model / saw this prompt", and a tenant's own fresh
  namespace is legitimately read before its first write (it is unbound then).
* Write (Allocate, WritePages, AppendTokens; Publish, made by nodes for a tenant: see
  services/node_calls.py): the WRITE right, and the namespace
  is the caller's or nobody's; its first successful write binds it to the caller (see
  owners.py). A write into another tenant's namespace is PERMISSION_DENIED: silently
  dropping it would lose the caller's data, and the denial only says that an id the
  caller already knows (ids are salted: it cannot compute another tenant's) is taken.
  ADMIN does not allow writing into another tenant's namespace (that is cache poisoning).
* Administer (Invalidate, Remove, EndSession): ADMIN, or WRITE and ownership. For a
  namespace the caller does not own it is, like a read, a no-op answered as for an empty
  namespace. Purging the quarantine list (one per tier, every tenant's pages) needs ADMIN.
* Filters (Subscribe, Stats, Quarantine): a caller sees its own namespaces; ADMIN sees all.

Without an auth file every caller is the local tenant, which has every right and binds
nothing: the server behaves as before tenants.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.errors import PermissionDenied
from kvstore.security.identity import Identity, Rights
from kvstore.server.tenancy.owners import NamespaceOwners
from kvstore.server.tenancy.quotas import Quotas


def _require(who: Identity, right: Rights) -> None:
    if not who.allows(right):
        raise PermissionDenied(f"tenant {who.tenant!r} lacks the {right.name.lower()} right")  # type: ignore[union-attr]


class Tenancy:
    """Thread-safe (see NamespaceOwners); every check is a dict read or two."""

    def __init__(self, owners: NamespaceOwners, quotas: Quotas) -> None:
        self.owners = owners
        self.quotas = quotas

    def tenants(self) -> list[str]:
        """The tenants an admin's Stats lists: those owning a namespace or given a quota."""
        return sorted({*self.owners.tenants(), *self.quotas.tenants_with_limits()})

    def sees(self, who: Identity, namespace_id: bytes) -> bool:
        """Whether events, stats and quarantine entries of the namespace are shown to ``who``."""
        return who.allows(Rights.ADMIN) or self.owners.owner(namespace_id) == who.tenant

    def may_read(self, who: Identity, namespace_id: bytes) -> bool:
        """PermissionDenied without the READ right; False: answer as for an empty namespace."""
        _require(who, Rights.READ)
        return self.sees(who, namespace_id)

    def may_administer(self, who: Identity, namespace_id: bytes) -> bool:
        """False: the namespace is not the caller's; answer as for an empty namespace."""
        if who.allows(Rights.ADMIN):
            return True
        _require(who, Rights.WRITE)
        return self.owners.owner(namespace_id) == who.tenant

    def check_purge(self, who: Identity) -> None:
        if not who.allows(Rights.ADMIN):
            raise PermissionDenied("purging the quarantine list needs the admin right: it holds every tenant's pages")

    def claim(self, who: Identity, namespace_id: bytes) -> bool:
        """Before a write: PermissionDenied unless the caller may write into the namespace.
        True: ``settle`` must follow, with whether the write succeeded."""
        _require(who, Rights.WRITE)
        if who.via == "local":  # no tenants: nothing to bind
            return False
        return self.owners.claim(namespace_id, who.tenant)

    def settle(self, who: Identity, namespace_id: bytes, succeeded: bool) -> None:
        self.owners.settle(namespace_id, who.tenant, succeeded)

    @contextmanager
    def writing(self, who: Identity, namespace_id: bytes) -> Iterator[None]:
        """Claims the namespace for the body's write; binds it if the body succeeds."""
        if not self.claim(who, namespace_id):
            yield
            return
        succeeded = False
        try:
            yield
            succeeded = True
        finally:
            self.settle(who, namespace_id, succeeded)
