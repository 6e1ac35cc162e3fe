"""A tenant's read that fetches pages into a namespace bound here only by its own first write,
still running (a claim, not settled): if that write fails, its binding is undone, and the pages the
read landed meanwhile sat in a namespace bound to nobody, which the next tenant to write there
would own, pages and all. So an Acquire's fill holds the claim as a write does until it settles
(the binding stays once a page landed), and a hint's prefetch, which runs after the hint answers,
fetches only into a namespace whose binding is settled. The interleavings are forced: the
cluster's fill stands in for the real one. Real NamespaceOwners on LMDB and the real Tenancy."""

from __future__ import annotations

from kvstore.lmdb_env import open_env
from kvstore.security.identity import Identity, Rights
from kvstore.server.tenancy.access import Tenancy
from kvstore.server.tenancy.cluster_reads import ClusterReads
from kvstore.server.tenancy.owners import NamespaceOwners

NS = bytes(range(32, 48))
KEYS = [bytes([i]) * 16 for i in range(2)]
B = Identity("b", Rights.READ | Rights.WRITE, b"salt-b")


class FirstWriteFailsDuringTheFill:
    """The cluster: its fill lands one page for the caller while the caller's first write here
    (claimed before the read) fails and settles; its prefetch is recorded."""

    def __init__(self, owners: NamespaceOwners) -> None:
        self.owners = owners
        self.core = None
        self.remote = self  # its remote tier: what is held here (local_prefix)
        self.num_held = 0
        self.prefetched: list[bytes] = []

    def fill(self, namespace_id: bytes, keys: list[bytes], time_remaining_s: float | None, tenant: str = "",
             landing: object = None) -> int:
        self.owners.settle(namespace_id, "b", False)  # the first write failed while the page landed
        self.num_held = 1
        return 1

    def local_prefix(self, namespace_id: bytes, keys: list[bytes]) -> int:
        return self.num_held

    def prefetch(self, namespace_id: bytes, keys: list[bytes], tenant: str = "", landing: object = None) -> bool:
        self.prefetched.append(namespace_id)
        return True


def _reads(tmp_path) -> tuple[NamespaceOwners, ClusterReads, FirstWriteFailsDuringTheFill]:
    owners = NamespaceOwners(open_env(tmp_path / "lmdb", 1 << 20, max_dbs=4))
    cluster = FirstWriteFailsDuringTheFill(owners)
    reads = ClusterReads(Tenancy(owners, None), cluster)  # type: ignore[arg-type]
    reads._landing = lambda who, ns, keys: None  # type: ignore[method-assign]  # no quotas here: the node's own landing
    return owners, reads, cluster


def test_a_fill_into_a_namespace_bound_by_a_pending_first_write_keeps_the_binding(tmp_path) -> None:
    owners, reads, _ = _reads(tmp_path)
    assert owners.claim(NS, "b")  # b's first write here, running
    assert reads.fill(B, NS, KEYS, 5.0)
    assert owners.owner(NS) == "b", "the page the fill landed sits in a namespace bound to nobody"


def test_a_hint_prefetches_only_into_a_settled_binding(tmp_path) -> None:
    owners, reads, cluster = _reads(tmp_path)
    assert owners.claim(NS, "b")
    reads.prefetch(B, NS, KEYS)
    assert cluster.prefetched == [], "a prefetch ran on a binding its first write may still undo"
    owners.settle(NS, "b", True)
    reads.prefetch(B, NS, KEYS)
    assert cluster.prefetched == [NS]
