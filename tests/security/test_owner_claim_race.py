"""A claim that answers False (no settle follows) must find the namespace bound to its tenant for
good. The lock-free shortcut in ``NamespaceOwners.claim`` read the owner while another first write's
failed settle was undoing the binding (its pending count already gone, the LMDB delete running):
it answered False, the binding then went, and the write ran into an unbound namespace. In the
cluster this was a direct handoff's page push at the decode node racing the prefill node's
announce (a Push without keys, which claims and then unbinds): the pages landed in the unowned
arena, the owner's client read its own arena at their offsets, PageCorrupt
(tests/cluster/test_handoff_tenants.py::test_another_tenant_or_a_forged_id_gets_nothing, under load)."""

from __future__ import annotations

import threading

from kvstore.lmdb_env import open_env
from kvstore.server.tenancy.owners import NamespaceOwners

NS = bytes(range(16))


def _owners(tmp_path) -> NamespaceOwners:
    return NamespaceOwners(open_env(tmp_path / "lmdb", 1 << 20, max_dbs=4))


def test_a_claim_during_a_failed_first_writes_unbinding_is_a_claim(tmp_path) -> None:
    owners = _owners(tmp_path)
    assert owners.claim(NS, "a") is True  # the announce: a first write that will store nothing
    answers: list[bool] = []
    writer = threading.Thread(target=lambda: answers.append(owners.claim(NS, "a")))
    unbind = owners._write

    def write(namespace_id: bytes, tenant: str | None) -> None:
        if tenant is None:  # the failed settle's delete is running: a page push claims now
            writer.start()
            writer.join(0.3)
        unbind(namespace_id, tenant)

    owners._write = write  # type: ignore[method-assign]
    owners.settle(NS, "a", False)
    writer.join(5)
    assert answers, "the second claim never returned"
    # False means "bound for good, nothing to settle": then the namespace must be bound
    assert answers == [True] or owners.owner(NS) == "a", (answers, owners.owner(NS))
    assert owners.owner(NS) == "a"  # the second write's claim bound it again
    owners.settle(NS, "a", True)
    assert owners.owner(NS) == "a" and owners.claim(NS, "a") is False

