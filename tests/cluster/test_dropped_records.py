"""A shard owner drops a node's records when the node leaves or registers again; the records
the new incarnation republished meanwhile stay, also those that arrived before the owner heard
of it; a late call of an incarnation that is over is refused."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.directory import Directory
from kvstore.errors import InvalidRequest, LimitExceeded, StaleIncarnation
from kvstore.server.cluster import incarnations as incarnations_module
from kvstore.server.cluster.incarnations import Incarnations
from kvstore.types import Location

NS = bytes(16)


def test_drop_node_keeps_what_was_published_after_the_membership_change(tmp_path: Path) -> None:
    """Race pinned: node b registers again and republishes at once; the owner's drop of b's
    old records runs later (in a worker) and must not take the fresh ones with it."""
    directory = Directory(tmp_path, "owner")
    try:
        old, fresh, other = b"o" * 16, b"f" * 16, b"x" * 16
        directory.publish_remote(NS, [(old, "b", "host", 4096), (other, "c", "host", 4096)], 100, 100)
        seen_at_change = directory.version  # the membership change: b registered again
        directory.publish_remote(NS, [(fresh, "b", "ssd", 4096)], 100, 100)  # b's republish, before the drop ran
        assert directory.drop_node("b", seen_at_change) == 1
        assert directory.get(old) is None
        assert directory.lookup(NS, [fresh])[0].node == "b"
        assert directory.lookup(NS, [other])[0].node == "c"
        assert directory.drop_node("b") == 1  # b left for good: everything of it goes
        assert directory.get(fresh) is None and directory.num_remote("b") == 0
        with pytest.raises(ValueError):
            directory.drop_node("owner")
    finally:
        directory.close()


@dataclass
class Owner:
    """A shard owner's directory and incarnation table, as the runtime and servicer use them."""

    directory: Directory
    incarnations: Incarnations

    def publish(self, epoch: int, page: bytes, tier: str = "host") -> None:
        """A Publish of one page of node b by its incarnation ``epoch``."""
        with self.incarnations.admitting(["b"], epoch):
            self.directory.publish_remote(NS, [(page, "b", tier, 4096)], 100, 100)

    def drop(self, epochs: dict[str, int]) -> int:
        """The watch says ``epochs``: what the runtime drops of each node whose incarnation ended."""
        return sum(self.directory.drop_node(node, up_to) for node, up_to in self.incarnations.watched(epochs))


@pytest.fixture
def owner(tmp_path: Path) -> Iterator[Owner]:
    directory = Directory(tmp_path, "owner")
    yield Owner(directory, Incarnations(lambda: directory.version))
    directory.close()


def test_an_owner_keeps_what_a_newer_incarnation_sent_before_it_heard_of_it(owner: Owner) -> None:
    """Race pinned (the churn test, CI of stop 32): b registered again and its republish reached
    the owner before the owner's watch said so; dropping b's records up to the moment it heard
    took the fresh ones too. Now the drop stops where the newer incarnation began."""
    directory, incarnations = owner.directory, owner.incarnations
    old, fresh = b"o" * 16, b"f" * 16
    assert incarnations.watched({"b": 1}) == []  # first heard of: nothing ended
    owner.publish(1, old)
    owner.publish(2, fresh, "ssd")  # b's republish (epoch 2), before the watch
    assert owner.drop({"b": 2}) == 1  # the watch: b registered again
    assert directory.get(old) is None
    assert directory.lookup(NS, [fresh])[0].node == "b"
    with pytest.raises(StaleIncarnation), incarnations.admitting(["b"], 1):  # epoch 1's call, late in flight
        pytest.fail("a call of an incarnation that is over was admitted")
    with incarnations.admitting(["b"], 0):  # a caller that names no epoch is not checked
        pass


def test_an_incarnation_heard_over_refuses_its_late_calls_and_the_next_one_is_kept(owner: Owner) -> None:
    directory, incarnations = owner.directory, owner.incarnations
    incarnations.watched({"b": 3})
    owner.publish(3, b"o" * 16)
    assert owner.drop({}) == 1  # b left (heard first): all of it goes
    with pytest.raises(StaleIncarnation), incarnations.admitting(["b"], 3):
        pytest.fail("a call of an incarnation that is over was admitted")
    owner.publish(4, b"n" * 16)  # b back under epoch 4, before the watch
    assert owner.drop({"b": 4}) == 0  # the watch catches up: epoch 4's stays
    assert owner.drop({"b": 4}) == 0  # and repeats itself
    assert directory.num_remote("b") == 1


def test_incarnations_the_watch_skipped_are_over_too(owner: Owner) -> None:
    """Review of 675101d: a batched watch can go from b's epoch 1 to epoch 3. Epoch 2 published
    before the owner heard of it and is over as well: its records go, epoch 3's stay. Before,
    the drop stopped where epoch 2 began and its records stayed for good."""
    directory, incarnations = owner.directory, owner.incarnations
    incarnations.watched({"b": 1})
    owner.publish(1, b"1" * 16)
    owner.publish(2, b"2" * 16)
    assert owner.drop({"b": 3}) == 2  # epoch 3 has sent nothing yet
    assert directory.get(b"1" * 16) is None and directory.get(b"2" * 16) is None
    with pytest.raises(StaleIncarnation), incarnations.admitting(["b"], 2):
        pytest.fail("a call of a skipped incarnation was admitted")
    owner.publish(3, b"3" * 16)
    assert directory.lookup(NS, [b"3" * 16])[0].node == "b"


def test_a_node_that_left_and_came_back_under_a_new_epoch_ends_what_it_sent_between(owner: Owner) -> None:
    """The watch says b left (epoch 1), then that b is back at epoch 3: epoch 2, never listed,
    published meanwhile. Before, a node coming back was not compared with anything."""
    directory, incarnations = owner.directory, owner.incarnations
    incarnations.watched({"b": 1})
    assert incarnations.watched({}) == [("b", directory.version)]
    owner.publish(2, b"2" * 16)
    assert owner.drop({"b": 3}) == 1
    assert directory.num_remote("b") == 0


def test_a_node_registered_anew_in_a_replaced_etcd_is_heard_again(owner: Owner) -> None:
    """Review of 675101d: etcd wiped or restored, a restarted b registers at epoch 1 again. Its
    calls were refused for good (epoch 5 was heard); now the watch seeing b's epoch go down voids
    what was heard of it, and b's old records go."""
    directory, incarnations = owner.directory, owner.incarnations
    incarnations.watched({"b": 5})
    owner.publish(5, b"5" * 16)
    assert owner.drop({"b": 1}) == 1
    owner.publish(1, b"1" * 16)
    assert directory.lookup(NS, [b"1" * 16])[0].node == "b"


def test_a_replaced_etcd_keeps_what_the_new_incarnation_sent_before_the_watch_said(owner: Owner) -> None:
    """Review of 9f2caed: the watch saw b at 5 (b@5 sent nothing here), b@1 (a replaced etcd)
    published, then the watch said 1: voiding what was heard dropped b@1's record too."""
    directory, incarnations = owner.directory, owner.incarnations
    incarnations.watched({"b": 5})
    owner.publish(1, b"1" * 16)
    assert owner.drop({"b": 1}) == 0
    assert directory.lookup(NS, [b"1" * 16])[0].node == "b"


def test_an_epoch_names_one_node_and_a_refused_publish_notes_no_epoch(owner: Owner) -> None:
    """One call naming an epoch for records of many nodes could stuff the table (or end any node's
    calls): refused. A publish that fails (here over its per-node limit) notes nothing."""
    directory, incarnations = owner.directory, owner.incarnations
    with pytest.raises(InvalidRequest), incarnations.admitting(["b", "c"], 7):
        pytest.fail("an epoch for two nodes was admitted")
    with pytest.raises(LimitExceeded), incarnations.admitting(["b"], 9):
        directory.publish_remote(NS, [(b"x" * 16, "b", "host", 4096), (b"y" * 16, "b", "host", 4096)], 1, 100)
    owner.publish(8, b"8" * 16)  # epoch 9 was not noted: 8 is still b's newest
    assert directory.num_remote("b") == 1


def test_at_its_bound_the_table_forgets_a_node_the_watch_does_not_list_first(owner: Owner,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Node ids are the caller's to name: a flood of made-up nodes must not push out what the
    table knows of a member (its older epoch's late calls would be admitted again)."""
    monkeypatch.setattr(incarnations_module, "MAX_NODES", 3)
    owner.incarnations.watched({"b": 1})
    owner.publish(2, b"2" * 16)  # b, a member, heard at epoch 2
    for i in range(10):  # made-up nodes, each heard once
        with owner.incarnations.admitting([f"fake-{i}"], 1):
            pass
    with pytest.raises(StaleIncarnation), owner.incarnations.admitting(["b"], 1):
        pytest.fail("b's epoch 2 was forgotten for made-up nodes")


def test_a_drop_racing_a_republish_of_the_same_page_keeps_the_fresh_record(tmp_path: Path) -> None:
    """Race pinned (review of 675101d): drop_node lists b's locations, then removes each; b's
    republish of the same page landing between the two replaced the old record with a fresh
    one, and the removal took the fresh one (it named the page, not the version)."""
    page = b"p" * 16

    class Republished(Directory):
        def locations_of(self, node: str) -> list[tuple[bytes, bytes, Location]]:
            found = super().locations_of(node)
            self.publish_remote(NS, [(page, "b", "host", 4096)], 100, 100)  # b's republish, after the listing
            return found

    directory = Republished(tmp_path, "owner")
    try:
        directory.publish_remote(NS, [(page, "b", "host", 4096)], 100, 100)
        bound = directory.version  # the old incarnation's last record
        assert directory.drop_node("b", bound) == 0
        assert directory.lookup(NS, [page])[0].node == "b", "b's fresh record was dropped with the old one"
    finally:
        directory.close()


def test_an_owner_that_registered_again_forgets_what_it_was_told_before(owner: Owner) -> None:
    """Bug (chaos seed 70099): an owner kept through a partition the records the others gave
    it, while they dropped the withdrawals they queued for it (an owner that left). Now what was
    published to it before it registered again goes before it serves; what came since stays;
    a call addressed to its previous epoch is refused (the sender retries once it heard)."""
    directory, incarnations = owner.directory, owner.incarnations
    old, fresh = b"o" * 16, b"f" * 16
    incarnations.registering(1)
    with incarnations.admitting(["b"], 1, owner_epoch=1):
        directory.publish_remote(NS, [(old, "b", "host", 4096)], 100, 100)
    incarnations.registering(2)  # its lease lost, it registers again
    with pytest.raises(StaleIncarnation, match="registered as epoch 2"), incarnations.admitting(["b"], 1, owner_epoch=1):
        pytest.fail("a call for the owner's previous epoch was admitted")
    with incarnations.admitting(["b"], 1, owner_epoch=2):  # b heard of the new epoch: its republish
        directory.publish_remote(NS, [(fresh, "b", "host", 4096)], 100, 100)
    assert incarnations.own_past(1) is None
    cut = incarnations.own_past(2)
    assert cut is not None
    assert directory.drop_others(cut) == 1
    assert directory.get(old) is None
    assert directory.lookup(NS, [fresh])[0].node == "b"
    assert directory.drop_others(cut) == 0  # a second catch-up drops nothing more
    assert incarnations.own_past(2) == cut
