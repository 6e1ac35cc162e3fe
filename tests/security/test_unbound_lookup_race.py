"""A tenant's lookup of a namespace nobody holds at its node is asked of the cluster
(cluster_reads.py): the decision is made before the lookup runs, and another tenant's first write
at that node can bind the namespace and store a page meanwhile. The lookup, which reads this
node's own directory first, then promised the other tenant's page to the caller. Found by
``kvstore-bench chaos`` (seed 1203: "the other tenant saw 1 pages of a's namespace", a probe
overlapping the owner's first put at that node). The interleaving is forced here: the cluster's
lookup stands in for the real one, and the owner's first write binds the namespace as it runs.
Real NamespaceOwners on LMDB and the real Tenancy."""

from __future__ import annotations

from kvstore.lmdb_env import open_env
from kvstore.security.identity import Identity, Rights
from kvstore.server.tenancy.access import Tenancy
from kvstore.server.tenancy.cluster_reads import ClusterReads
from kvstore.server.tenancy.owners import NamespaceOwners
from kvstore.types import LocationRun

NS = bytes(range(16))
KEYS = [bytes([i]) * 16 for i in range(2)]


class FirstWriteMeanwhile:
    """The cluster's lookup, during which tenant ``a`` claims the namespace (its first write at
    this node: the binding comes before its commit) and stores the first page, which this
    node's directory then answers."""

    def __init__(self, owners: NamespaceOwners) -> None:
        self.owners = owners
        self.asked: list[str] = []

    def lookup(self, namespace_id: bytes, keys: list[bytes], time_remaining_s: float | None, tenant: str = "") -> list[LocationRun]:
        self.asked.append(tenant)
        assert self.owners.claim(namespace_id, "a")
        self.owners.settle(namespace_id, "a", True)
        return [LocationRun("n3", "host", 1, 4096)]


def _reads(tmp_path) -> tuple[NamespaceOwners, ClusterReads, FirstWriteMeanwhile]:
    owners = NamespaceOwners(open_env(tmp_path / "lmdb", 1 << 20, max_dbs=4))
    cluster = FirstWriteMeanwhile(owners)
    return owners, ClusterReads(Tenancy(owners, None), cluster), cluster  # type: ignore[arg-type]


def test_a_lookup_of_an_unbound_namespace_promises_nothing_another_tenant_wrote_meanwhile(tmp_path) -> None:
    owners, reads, cluster = _reads(tmp_path)
    b = Identity("b", Rights.READ | Rights.WRITE, b"salt-b")
    assert owners.owner(NS) is None
    runs = reads.lookup(b, NS, KEYS, 5.0)
    assert cluster.asked, "the unbound namespace was asked of the cluster"
    assert owners.owner(NS) == "a"
    assert runs == [], f"tenant b was promised tenant a's page: {runs}"


def test_a_lookup_of_an_unbound_namespace_answers_its_callers_pages(tmp_path) -> None:
    """The fix keeps the read it is for: a namespace bound to nobody, or to the caller, at the
    lookup's end answers what the cluster found."""
    _, reads, _ = _reads(tmp_path)
    a = Identity("a", Rights.READ | Rights.WRITE, b"salt-a")
    assert reads.lookup(a, NS, KEYS, 5.0) == [LocationRun("n3", "host", 1, 4096)]
