"""kvstore: a tiered KV-cache store for LLM inference.

``from kvstore import KVLayout, Namespace``; the worker library is ``kvstore.client``.
"""

from kvstore.errors import KVStoreError
from kvstore.types import KVLayout, Location, Namespace

__all__ = ["KVLayout", "KVStoreError", "Location", "Namespace"]
__version__ = "0.1.0"
