"""vLLM KV connector backed by kvstore: ``kv_connector="KVStoreConnector"``,
``kv_connector_module_path="kvstore.client.adapters.vllm"``.

More: client/adapters/vllm/README.md (### `__init__.py`).
"""

from kvstore.client.adapters.vllm.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]
