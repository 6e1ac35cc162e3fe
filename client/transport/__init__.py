"""One transport per path page bytes take: ``ShmTransport`` (the server's shared-memory
arena) and ``StreamTransport`` (gRPC streams). See ``contract`` for the contract."""

from kvstore.client.transport.contract import NamespaceServer, Outgoing, Staged, Transport
from kvstore.client.transport.shm import ShmTransport
from kvstore.client.transport.stream import StreamTransport

__all__ = ["NamespaceServer", "Outgoing", "ShmTransport", "Staged", "StreamTransport", "Transport"]
