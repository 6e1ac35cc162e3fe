"""What a caller may do with the namespace a request names (DESIGN §11).

More: kvstore/server/tenancy/README.md (### access.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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

    @contextmanager
    def copying(self, who: Identity, namespace_id: bytes, held: Callable[[], int]) -> Iterator[None]:
        """Claims the namespace for the body's copy from another node and binds it if the copy stored
        pages: more are ``held`` here once the body ended than before it, raised or not (a batch committed
        before a failure stays its tenant's, not left in an unbound namespace, unreadable by it; DESIGN §11)."""
        if not self.claim(who, namespace_id):
            yield
            return
        before = held()
        try:
            yield
        finally:
            self.settle(who, namespace_id, held() > before)
