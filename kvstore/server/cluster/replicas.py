"""``replicas=n`` (DESIGN §12 "a put may ask for replicas=n"): the node holding the pages asks
n - 1 other members to copy them, and answers once they did.

More: kvstore/server/cluster/README.md (### replicas.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from kvstore._proto import data_pb2
from kvstore.cluster.members import Member
from kvstore.cluster.shards import score
from kvstore.server.cluster.peers import Peers, current_cancelled
from kvstore.server.cluster.remote import RemoteTier

logger = logging.getLogger(__name__)

def targets(node: str, members: Mapping[str, Member], first_key: bytes, count: int) -> list[str]:
    """The ``count`` other members that hold replicas of a prefix starting at ``first_key``."""
    others = sorted((m for m in members if m != node), key=lambda m: (score(m, first_key), m), reverse=True)
    return others[:count]


def held_by_n(local: int, copies: list[int], replicas: int) -> int:
    """Leading pages held on at least ``replicas`` nodes: this one holds ``local``, target i
    the first ``copies[i]``."""
    if replicas <= 1:
        return local
    best = sorted(copies, reverse=True)
    return min(local, best[replicas - 2]) if len(best) >= replicas - 1 else 0


class Replicas:
    def __init__(self, node: str, remote: RemoteTier, peers: Peers, members: Callable[[], Mapping[str, Member]],
                 rpc_timeout_s: float) -> None:
        self._node = node
        self._remote = remote
        self._peers = peers
        self._members = members
        self._rpc_timeout_s = rpc_timeout_s

    def _page_bytes(self, key: bytes) -> int:
        entry = self._remote.core.directory.get(key)
        sizes = [loc.size_bytes for (node, _), loc in list(entry.locations.items()) if node == self._node] if entry else []
        return sizes[0] if sizes else 0

    async def replicate(self, namespace_id: bytes, keys: list[bytes], replicas: int, timeout_s: float, tenant: str) -> int:
        local = self._remote.local_prefix(namespace_id, keys)
        if local == 0 or replicas <= 1:
            return local
        chosen = targets(self._node, self._members(), keys[0], replicas - 1)
        request = data_pb2.ReplicateRequest(namespace_id=namespace_id, keys=keys[:local], replicas=replicas, holder=self._node,
                                            tenant=tenant, page_bytes=self._page_bytes(keys[0]))
        copies = await asyncio.gather(*(self._ask(target, request, timeout_s) for target in chosen))
        return held_by_n(local, list(copies), replicas)

    async def _ask(self, target: str, request: data_pb2.ReplicateRequest, timeout_s: float) -> int:
        peer = self._peers.get(target)
        if peer is None:
            return 0
        try:
            return int((await peer.data.Replicate(request, timeout=timeout_s)).num_pages)
        except asyncio.CancelledError:
            if current_cancelled():
                raise
            logger.warning("node %s: replica at %s ended with its channel (it left the cluster)", self._node, target)
            return 0  # grpc.aio cancels the calls of a channel closed under them
        except Exception as exc:  # noqa: BLE001 - a target that fails holds no replica
            logger.warning("node %s: replica of %d pages at %s failed: %r", self._node, len(request.keys), target, exc)
            return 0
