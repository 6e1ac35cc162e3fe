"""The other nodes as this node calls them: a gRPC channel (directory calls, the ReadPages
fallback) and, on the UCX or TCP data plane, a page fetcher per node.

A node is a caller like any other: its channels present the cluster token
(``KVSTORE_CLUSTER_TOKEN``) and, when the server runs TLS, its own certificate, trusting the
CA given as ``--tls-client-ca`` (one cluster CA signs every node's certificate). Lives on the
cluster loop: channels and fetchers are made, used and closed there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import grpc

from kvstore._proto import data_pb2, data_pb2_grpc, directory_pb2_grpc
from kvstore.cluster.cluster_errors import TransportError
from kvstore.cluster.members import Member
from kvstore.config import ClusterConfig, SecurityConfig
from kvstore.page_wire.grpc_chunks import CLIENT_OPTIONS, PageStubs
from kvstore.security.channel import ClientTLS, aio_channel

logger = logging.getLogger(__name__)


def current_cancelled() -> bool:
    """Whether the running task itself is being cancelled. A call on a peer's channel also
    raises CancelledError when the channel is closed under it (the peer left the cluster and
    ``update`` closed it): that is the peer's failure, not the caller's cancellation."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def client_tls(security: SecurityConfig) -> ClientTLS | None:
    """The TLS this node calls the others with: none unless it serves TLS itself."""
    if security.tls_cert is None:
        return None
    return ClientTLS(ca=security.tls_client_ca, cert=security.tls_cert, key=security.tls_key)


class PeerNode:
    """One other node, as its member record names it (a new epoch makes a new PeerNode)."""

    def __init__(self, me: str, member: Member, cluster: ClusterConfig, tls: ClientTLS | None, ucx: Any) -> None:
        self._me = me
        self._rpc_timeout_s = cluster.rpc_timeout_s
        self.member = member
        self.channel = aio_channel(member.grpc_address, CLIENT_OPTIONS, token=cluster.token, tls=tls)
        self.directory = directory_pb2_grpc.DirectoryStub(self.channel)
        self.data = data_pb2_grpc.DataStub(self.channel)
        self.pages = PageStubs(self.channel)
        self.fetcher: Any = None
        host, _, port = member.data_address.rpartition(":")
        if ucx is not None and member.data_address:
            from kvstore.cluster.transport_ucx import UcxPageFetcher

            self.fetcher = UcxPageFetcher(host, int(port), ucx, grant=self._grant)
        elif cluster.data_plane == "tcp" and member.data_address:
            from kvstore.cluster.transport_tcp import TcpPageFetcher

            self.fetcher = TcpPageFetcher(host.strip("[]"), int(port), grant=self._grant)

    async def _grant(self) -> bytes:
        """A grant for one connection to the peer's data port, asked over the authenticated channel."""
        try:
            answer = await self.data.GrantTransfer(data_pb2.GrantTransferRequest(node=self._me), timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise TransportError(f"node {self.member.node_id} gave no data-plane grant: {exc.code().name} {exc.details()}") from None
        except asyncio.CancelledError:
            if current_cancelled():
                raise
            raise TransportError(f"node {self.member.node_id} left while asked for a data-plane grant") from None  # its channel closed
        return answer.grant

    async def close(self) -> None:
        if self.fetcher is not None:
            await self.fetcher.close()
        await self.channel.close(grace=None)


class Peers:
    """node id -> PeerNode for the live members but this one; ``update`` follows membership."""

    def __init__(self, me: str, cluster: ClusterConfig, security: SecurityConfig, ucx: Any) -> None:
        self._me = me
        self._cluster = cluster
        self._tls = client_tls(security)
        self._ucx = ucx
        self._peers: dict[str, PeerNode] = {}

    def get(self, node: str) -> PeerNode | None:
        return self._peers.get(node)

    def update(self, members: Mapping[str, Member]) -> list[PeerNode]:
        """Opens peers for new members (or new epochs of known ones) at once; returns those
        gone, for the caller to close."""
        gone = []
        for node, peer in list(self._peers.items()):
            current = members.get(node)
            if current is None or current.epoch != peer.member.epoch or current.grpc_address != peer.member.grpc_address:
                gone.append(self._peers.pop(node))
        for node, member in members.items():
            if node != self._me and node not in self._peers:
                self._peers[node] = PeerNode(self._me, member, self._cluster, self._tls, self._ucx)
        return gone

    async def close(self) -> None:
        peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            await peer.close()
