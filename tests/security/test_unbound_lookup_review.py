"""Review of the unbound-lookup fix (test_unbound_lookup_race.py): the binding was read again only
after a lookup that began unbound. A lookup that began bound to its caller has the same race: the
binding it passed on may be the caller's own first write still running (a claim, not yet settled),
which fails and is undone while the lookup runs; another tenant's first write then binds the
namespace and stores a page, which the lookup (this node's directory first) answered to the
caller. The interleaving is forced as there: the cluster's lookup stands in for the real one.
Real NamespaceOwners on LMDB and the real Tenancy."""

from __future__ import annotations

from kvstore.lmdb_env import open_env
from kvstore.security.identity import Identity, Rights
from kvstore.server.tenancy.access import Tenancy
from kvstore.server.tenancy.cluster_reads import ClusterReads
from kvstore.server.tenancy.owners import NamespaceOwners
from kvstore.types import LocationRun

NS = bytes(range(16, 32))
KEYS = [bytes([i]) * 16 for i in range(2)]
PAGE = LocationRun("n3", "host", 1, 4096)


class OwnFirstWriteFailsMeanwhile:
    """The cluster's lookup, during which the caller's first write (claimed before the lookup)
    fails and its binding is undone, then tenant ``a``'s first write binds the namespace and
    stores a page, which this node's directory answers."""

    def __init__(self, owners: NamespaceOwners, caller: str) -> None:
        self.owners, self.caller = owners, caller

    def lookup(self, namespace_id: bytes, keys: list[bytes], time_remaining_s: float | None, tenant: str = "") -> list[LocationRun]:
        self.owners.settle(namespace_id, self.caller, False)
        assert self.owners.owner(namespace_id) is None
        assert self.owners.claim(namespace_id, "a")
        self.owners.settle(namespace_id, "a", True)
        return [PAGE]


def test_a_lookup_bound_by_the_callers_failing_first_write_promises_nothing_of_another_tenant(tmp_path) -> None:
    owners = NamespaceOwners(open_env(tmp_path / "lmdb", 1 << 20, max_dbs=4))
    reads = ClusterReads(Tenancy(owners, None), OwnFirstWriteFailsMeanwhile(owners, "b"))  # type: ignore[arg-type]
    b = Identity("b", Rights.READ | Rights.WRITE, b"salt-b")
    assert owners.claim(NS, "b")  # b's first write here, running: the namespace is b's until it settles
    runs = reads.lookup(b, NS, KEYS, 5.0)
    assert owners.owner(NS) == "a"
    assert runs == [], f"tenant b was promised tenant a's page: {runs}"


def test_a_lookup_of_the_callers_own_namespace_answers_its_pages(tmp_path) -> None:
    """What the fix keeps: the caller's binding settled, or an admin's read of another tenant's
    namespace, the lookup answers what the cluster found."""
    owners = NamespaceOwners(open_env(tmp_path / "lmdb", 1 << 20, max_dbs=4))

    class Found:
        def lookup(self, *args: object, **kwargs: object) -> list[LocationRun]:
            return [PAGE]

    reads = ClusterReads(Tenancy(owners, None), Found())  # type: ignore[arg-type]
    assert owners.claim(NS, "b")
    owners.settle(NS, "b", True)
    assert reads.lookup(Identity("b", Rights.READ, b"salt-b"), NS, KEYS, 5.0) == [PAGE]
    operator = Identity("ops", Rights.READ | Rights.ADMIN, b"", via="local")  # reads every tenant's namespaces
    assert reads.lookup(operator, NS, KEYS, 5.0) == [PAGE]
