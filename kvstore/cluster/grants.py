"""One-time grants for the UCX data plane (DESIGN §11-12): the data port has no identity of
its own, so a connection to it is served only after it presents a grant that this node
handed out over its authenticated control plane (gRPC ``Data.GrantTransfer``, node right).

A grant is 128 random bits, bound to the node that asked for it, live for ``ttl_s`` and
taken by the first connection that presents it. It authorizes the connection, not single
pages: a node with the node right may already read any tenant's pages over gRPC
(``ReadPages`` naming the tenant), so a grant per fetch would add a control-plane round trip
to every fetch and no protection; a grant per connection costs one round trip per connect.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

from kvstore.errors import LimitExceeded

logger = logging.getLogger(__name__)

GRANT_BYTES = 16
GRANT_TTL_S = 10.0
MAX_OPEN_GRANTS = 1024  # grants issued and not yet taken nor expired: a node connects to each peer once
MAX_OPEN_PER_NODE = 64  # of them to one node id: one node in a reconnect loop leaves the others room


class TransferGrants:
    """Thread-safe: issued from gRPC worker threads, taken on the cluster loop."""

    def __init__(self, ttl_s: float = GRANT_TTL_S, max_open: int = MAX_OPEN_GRANTS, max_per_node: int = MAX_OPEN_PER_NODE) -> None:
        self.ttl_s = ttl_s
        self._max_open = max_open
        self._max_per_node = max_per_node
        self._lock = threading.Lock()
        self._open: dict[bytes, tuple[str, float]] = {}  # grant -> (node it was issued to, expiry on the monotonic clock)

    def issue(self, node: str) -> bytes:
        """A new grant for ``node`` (an authenticated caller with the node right)."""
        now = time.monotonic()
        with self._lock:
            self._open = {g: (n, t) for g, (n, t) in self._open.items() if t > now}
            if len(self._open) >= self._max_open:
                raise LimitExceeded(f"{len(self._open)} data-plane grants are open already; connect with one of them first")
            if sum(n == node for n, _ in self._open.values()) >= self._max_per_node:
                raise LimitExceeded(f"node {node!r} holds {self._max_per_node} open data-plane grants already; "
                                    "connect with one of them first")
            grant = secrets.token_bytes(GRANT_BYTES)
            self._open[grant] = (node, now + self.ttl_s)
        return grant

    def take(self, grant: bytes) -> str | None:
        """The node ``grant`` was issued to, if it is live (it is used up now); None otherwise."""
        with self._lock:
            found = self._open.pop(bytes(grant), None)
        if found is None or found[1] <= time.monotonic():
            return None
        return found[0]
