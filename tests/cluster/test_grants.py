"""The one-time grants of the UCX data plane (kvstore/cluster/grants.py)."""

from __future__ import annotations

import time

import pytest

from kvstore.cluster.grants import GRANT_BYTES, MAX_OPEN_GRANTS, TransferGrants
from kvstore.errors import LimitExceeded


def test_a_grant_is_random_bound_to_its_node_and_taken_once() -> None:
    grants = TransferGrants()
    one, two = grants.issue("n1"), grants.issue("n2")
    assert len(one) == GRANT_BYTES and one != two
    assert grants.take(two) == "n2"
    assert grants.take(one) == "n1"
    assert grants.take(one) is None  # used up
    assert grants.take(bytes(GRANT_BYTES)) is None


def test_an_expired_grant_is_refused() -> None:
    grants = TransferGrants(ttl_s=0.05)
    grant = grants.issue("n1")
    time.sleep(0.1)  # the clock must pass the expiry; no event marks it
    assert grants.take(grant) is None


def test_open_grants_are_bounded() -> None:
    grants = TransferGrants(max_open=2)
    grants.issue("n1")
    grants.issue("n1")
    with pytest.raises(LimitExceeded):
        grants.issue("n1")
    short = TransferGrants(ttl_s=0.01, max_open=1)
    short.issue("n1")
    time.sleep(0.05)
    assert short.take(short.issue("n1")) == "n1"  # the expired one made room


def test_one_node_cannot_take_every_open_grant() -> None:
    """A node whose connects keep failing after their grant (a data port it cannot reach,
    a reconnect loop) asks a grant per attempt: it must not use up the node's open grants
    and leave every other node without a data-plane connection for the grants' TTL."""
    grants = TransferGrants()
    for _ in range(MAX_OPEN_GRANTS):
        try:
            grants.issue("flapping")
        except LimitExceeded:
            break
    assert grants.take(grants.issue("other")) == "other"
