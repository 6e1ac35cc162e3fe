"""A shard owner drops a node's records when the node leaves or registers again; the records
the new incarnation republished meanwhile stay."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.directory import Directory

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
