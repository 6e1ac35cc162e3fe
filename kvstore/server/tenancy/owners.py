"""Which tenant owns each namespace id: bound at the namespace's first successful write,
kept in the directory's LMDB (table ``owners``) so that it survives a restart.

The first write into an unbound namespace binds it to its tenant before it runs (one LMDB
write per namespace, ever: the events of that write must already be shown to the owner)
and settles after: if no first write succeeded, the binding is undone, so a rejected
request binds nothing. Meanwhile no other tenant can write into it.

More: kvstore/server/tenancy/README.md (### owners.py).
"""

from __future__ import annotations

import logging
import threading

import lmdb

from kvstore.errors import PermissionDenied
from kvstore.lmdb_env import map_full
from kvstore.tiers.base import UNOWNED
from kvstore.tiers.owner_parts import OwnerWords

logger = logging.getLogger(__name__)

TABLE = b"owners"


def owner_for(tenant: str) -> str:
    """The owner the placement core, its lease table and the tiers know ``tenant`` by: an opaque
    key of its arena, its hbm pool, its handles and the counters its quotas read (DESIGN §11).
    The one place tenants become owners: today a tenant's owner is its name."""
    return tenant


def tenant_for(owner: str) -> str:
    """The tenant ``owner`` stands for (``owner_for``'s inverse: its arena is sized by that tenant's quota)."""
    return owner


def _named(owner: str) -> str:
    return f"tenant {tenant_for(owner)!r}"


# How the tiers' logs and refusals name an owner's part, and what sizes its arena (its tenant's quota).
OWNER_WORDS = OwnerWords(_named, "the tenant's host_bytes quota")


class NamespaceOwners:
    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env
        self._db = env.open_db(TABLE)
        self._lock = threading.Lock()
        self._pending: dict[bytes, int] = {}  # namespace bound by a first write still running -> writes in flight
        self._owners: dict[bytes, str] = {}
        self._settled: dict[bytes, str] = {}  # bindings no settle can undo (a first write succeeded): never removed
        self._by_tenant: dict[str, set[bytes]] = {}
        with env.begin(db=self._db) as txn:
            for namespace_id, tenant in txn.cursor():
                self._remember(bytes(namespace_id), bytes(tenant).decode())
        self._settled.update(self._owners)  # every stored binding's first write succeeded
        logger.info("namespace owners: %d namespace(s) of %d tenant(s)", len(self._owners), len(self._by_tenant))

    def _remember(self, namespace_id: bytes, tenant: str) -> None:
        self._owners[namespace_id] = tenant
        self._by_tenant.setdefault(tenant, set()).add(namespace_id)

    def owner(self, namespace_id: bytes) -> str | None:
        return self._owners.get(namespace_id)

    def settled(self, namespace_id: bytes) -> bool:
        """Bound by a write that succeeded: no settle can undo it."""
        return namespace_id in self._settled

    def core_owner(self, namespace_id: bytes) -> str:
        """The owner of the namespace's pages in the core (``owner_for`` its tenant; UNOWNED: none)."""
        tenant = self._owners.get(namespace_id)
        return UNOWNED if tenant is None else owner_for(tenant)

    def tenants(self) -> list[str]:
        with self._lock:
            return sorted(t for t, namespaces in self._by_tenant.items() if namespaces)

    def namespaces_of(self, tenant: str) -> frozenset[bytes]:
        with self._lock:
            return frozenset(self._by_tenant.get(tenant, ()))

    def claim(self, namespace_id: bytes, tenant: str) -> bool:
        """Lets ``tenant`` write into the namespace; PermissionDenied when another tenant owns
        it. An unbound namespace is bound to ``tenant`` now (persisted first: on MetadataFull
        nothing is bound), before the write runs, so that the write's events are already
        shown to its owner; True: ``settle`` must follow, and undoes the binding when no
        first write succeeded."""
        # Lock-free only for a binding that can no longer be undone: reading "owner is tenant,
        # nothing pending" from ``_owners`` and ``_pending`` could catch a failed first write's
        # settle undoing the binding (its count gone, the LMDB delete running), and this write
        # would then run unclaimed into an unbound namespace (its pages in the unowned arena).
        if self._settled.get(namespace_id) == tenant:
            return False
        with self._lock:
            owner = self._owners.get(namespace_id)
            if owner is None:
                self._write(namespace_id, tenant)
                self._remember(namespace_id, tenant)
                self._pending[namespace_id] = 1
                return True
            if owner != tenant:
                raise PermissionDenied(f"namespace {namespace_id.hex()} belongs to another tenant")
            if namespace_id not in self._pending:
                return False
            self._pending[namespace_id] += 1
            return True

    def settle(self, namespace_id: bytes, tenant: str, succeeded: bool) -> None:
        """Ends a claim. The binding stays once one of the first writes succeeded; when the
        last of them ends and none did, it is undone."""
        with self._lock:
            count = self._pending.get(namespace_id)
            if count is None:
                return  # a first write succeeded already
            if succeeded:
                self._settled[namespace_id] = tenant
                del self._pending[namespace_id]
            elif count > 1:
                self._pending[namespace_id] = count - 1
            else:
                del self._pending[namespace_id]
                self._write(namespace_id, None)
                del self._owners[namespace_id]
                self._by_tenant[tenant].discard(namespace_id)
                logger.debug("namespace %s: its first write failed, left unbound", namespace_id.hex())
                return
        if succeeded:
            logger.info("namespace %s bound to tenant %s", namespace_id.hex(), tenant)

    def _write(self, namespace_id: bytes, tenant: str | None) -> None:
        with map_full(self._env, "the namespace owner table"), self._env.begin(write=True, db=self._db) as txn:
            if tenant is None:
                txn.delete(namespace_id)
            else:
                txn.put(namespace_id, tenant.encode())
