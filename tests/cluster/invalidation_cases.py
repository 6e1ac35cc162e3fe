"""What the invalidation tests share: prefixes whose records live on chosen owners, a node
reached only through a proxy, and a read that checks every byte it is served."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import torch
from support.cluster_nodes import Node
from support.tcp_proxy import TcpProxy
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore import keys as page_keys
from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.cluster.shards import ShardConfig, ShardMap
from kvstore.errors import KVStoreError, PageMissing


def tokens_owned_by(members: list[str], owners: set[str], pages: int, first_seed: int = 1) -> list[int]:
    """A prefix of ``pages`` pages every record of which a node of ``owners`` keeps (the
    nodes' own map: per-page owners over ``members``)."""
    shards = ShardMap(members, ShardConfig(segment_pages=1, replicas=1))
    for seed in range(first_seed, first_seed + 100_000):
        tokens = tokens_of(seed, pages)
        keys = page_keys.page_keys(NS.namespace_id, tokens, LAYOUT.page_tokens)
        if all(set(shards.owners(k)) <= owners for k in keys):
            return tokens
    raise AssertionError(f"no prefix of {pages} pages owned by {owners} among {members}")


def proxied(tmp: Path, name: str, etcd_url: str, data_plane: str, *extra: str) -> tuple[Node, TcpProxy]:
    """A node the others reach only through a proxy (it advertises the proxy's address): the
    test can hold back what it answers its peers."""
    node = Node(tmp, name, etcd_url, data_plane, *extra)
    proxy = TcpProxy(("127.0.0.1", node.port))
    node.args += ["--advertise", f"127.0.0.1:{proxy.port}"]
    return node, proxy


@contextmanager
def cut_off_later(tmp: Path, etcd_port: int, name: str, data_plane: str, *extra: str) -> Iterator[tuple[Node, Callable[[], None]]]:
    """A node reached by etcd and by its peers only through proxies, started: (the node, ``cut``, which cuts
    both at once; it serves on until its lease's TTL is out). Links restored, node stopped, proxies closed at the end."""
    etcd_link = TcpProxy(("127.0.0.1", etcd_port))
    node, peer_link = proxied(tmp, name, f"etcd://127.0.0.1:{etcd_link.port}", data_plane, *extra)

    def cut() -> None:
        etcd_link.cut()
        peer_link.cut()

    try:
        node.start()
        yield node, cut
    finally:
        etcd_link.restore()
        peer_link.restore()
        node.stop()
        etcd_link.close()
        peer_link.close()


async def invalidate(address: str, namespace_id: bytes, keys: list[bytes] | None = None,
                     timeout_s: float = 30) -> directory_pb2.InvalidateResponse:
    """Directory.Invalidate at a node (loopback: no token)."""
    async with grpc.aio.insecure_channel(address) as channel:
        request = directory_pb2.InvalidateRequest(namespace_id=namespace_id, keys=keys or [])
        return await directory_pb2_grpc.DirectoryStub(channel).Invalidate(request, timeout=timeout_s)


async def read_checked(address: str, tokens: list[int], expected: torch.Tensor, what: str) -> int:
    """Looks ``tokens`` up at a node and reads what it promises; every token served must equal
    ``expected``. Returns how many tokens were served."""
    async with KVStoreClient(address, NS) as client:
        hit = await client.lookup(tokens)
        out = torch.zeros_like(expected)
        try:
            n = await client.get(hit, out) if hit.num_tokens else 0
        except PageMissing as exc:
            n = exc.num_tokens  # type: ignore[attr-defined]
        except KVStoreError:
            n = 0
        assert torch.equal(out[:, :, :n], expected[:, :, :n]), f"{what}: wrong bytes served"
        return n


async def served(address: str, tokens: list[int], token: str | None = None) -> int:
    """How many tokens of ``tokens`` a node serves now (looked up, then read whole; as ``token``'s tenant)."""
    async with KVStoreClient(address, NS, token=token) as client:
        hit = await client.lookup(tokens)
        if not hit.num_tokens:
            return 0
        out = torch.zeros((LAYOUT.num_layers, LAYOUT.kv_factor, len(tokens), LAYOUT.num_kv_heads, LAYOUT.head_dim),
                          dtype=LAYOUT.torch_dtype())
        try:
            return await client.get(hit, out)
        except PageMissing as exc:
            return exc.num_tokens  # type: ignore[attr-defined]
