"""The client's calls on its namespace as a whole and across the nodes of a cluster: an
invalidation (the namespace's generation goes up) and replicas of a prefix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore._proto import data_pb2, directory_pb2

if TYPE_CHECKING:
    from kvstore.client.calls import Calls
    from kvstore.types import Namespace


class NamespaceCalls:
    """Mixed into KVStoreClient, whose ``namespace`` and ``calls`` these use."""

    namespace: Namespace
    calls: Calls

    async def invalidate(self) -> int:
        """Drops every page of this client's namespace (the admin right, or the namespace's
        owner): its generation goes up by one, in cluster mode at every node before this
        returns. Returns the new generation (a put naming an older one is refused)."""
        request = directory_pb2.InvalidateRequest(namespace_id=self.namespace.namespace_id)
        return int((await self.calls.unary("Directory.Invalidate", request)).generation)

    async def replicate_keys(self, keys: list[bytes], replicas: int) -> int:
        """Has ``replicas`` nodes of the cluster (this server included) hold the pages of
        ``keys`` that this server holds: it asks ``replicas - 1`` other members to copy them and
        answers once they did, or at the deadline. Returns how many leading pages are held on
        at least ``replicas`` nodes: fewer when the cluster has fewer live members or a copy
        failed (best effort, counted; a replica is an ordinary copy afterwards, evictable).
        A single server answers what it holds for ``replicas=1`` and refuses more."""
        request = data_pb2.ReplicateRequest(namespace_id=self.namespace.namespace_id, keys=keys, replicas=replicas)
        return int((await self.calls.unary("Data.Replicate", request)).num_pages)
