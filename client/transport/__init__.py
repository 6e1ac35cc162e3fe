"""One transport per path page bytes take: ``ShmTransport`` (the server's shared-memory
arena) and ``StreamTransport`` (gRPC streams). See ``base`` for the contract."""

from kvstore.client.transport.base import Outgoing, Peer, Staged, Transport
from kvstore.client.transport.shm import ShmTransport
from kvstore.client.transport.stream import StreamTransport

__all__ = ["Outgoing", "Peer", "ShmTransport", "Staged", "StreamTransport", "Transport"]
