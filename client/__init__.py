"""The library inference workers embed. Import as ``kvstore.client``."""

from kvstore.client.client import Hit, KVStoreClient
from kvstore.client.handoff import new_handoff_id
from kvstore.security.channel import ClientTLS

__all__ = ["ClientTLS", "Hit", "KVStoreClient", "new_handoff_id"]
