"""vLLM KV connector backed by kvstore: ``kv_connector="KVStoreConnector"``,
``kv_connector_module_path="kvstore.client.adapters.vllm"``.

| module | what |
| --- | --- |
| `connector.py` | `KVStoreConnector`, the `KVConnectorBase_V1` vLLM loads; dispatches by role |
| `scheduler.py` | lookups (one per request, cached), the loads and saves of each step |
| `worker.py` | layer-wise loads and saves on vLLM's paged KV, load errors, finished saves |
| `layout.py` | each attention backend's per-layer KV tensor as `[blocks, K/V, block, heads, dim]` |
| `metadata.py` | what the scheduler sends the workers each step |
| `config.py` | `kv_connector_extra_config` and the engine's kvstore namespace (no vLLM import) |

``kvstore.client.adapters.connection`` runs the asyncio client for these synchronous hooks.
"""

from kvstore.client.adapters.vllm.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]
