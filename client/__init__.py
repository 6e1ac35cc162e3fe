"""The library inference workers embed. Import as ``kvstore.client``."""

from kvstore.client.client import Hit, KVStoreClient

__all__ = ["Hit", "KVStoreClient"]
