"""vLLM KV connector backed by kvstore: ``kv_connector="KVStoreConnector"``,
``kv_connector_module_path="kvstore.client.adapters.vllm"``.

| module | what |
| --- | --- |
| `connector.py` | `KVStoreConnector`, the `KVConnectorBase_V1` (and `SupportsHMA`) vLLM loads; dispatches by role and by groups |
| `scheduler.py` | lookups (one per request, cached), the loads and saves of each step |
| `worker.py` | layer-wise loads and saves on vLLM's paged KV, load errors, finished saves |
| `layout.py` | each attention backend's per-layer KV tensor as `[blocks, K/V, block, heads, dim]` |
| `metadata.py` | what the scheduler sends the workers each step |
| `connector_settings.py` | `kv_connector_extra_config` and the engine's kvstore namespace (no vLLM import) |
| `groups.py` | an engine's KV cache groups (full, sliding-window, chunked-local, state-space) and their layout in the namespace |
| `sessions.py` | a request's session (`kvstore_session_id`): its tokens logged at its node, its saves naming it, the request stopped when a live migration's fence refuses them; a moved session continued from its log |
| `pd.py`, `pd_worker.py` | disaggregated prefill: a prefill instance's handoff (open, complete) and a decode instance's asynchronous load of it |
| `hybrid_scheduler.py`, `hybrid_worker.py` | the sides of hybrid engines: whole loads before the request computes, saves copied out when the step ends |
| `grouped.py` | a hybrid page's layers copied through their groups' block tables, null blocks skipped |
| `hybrid_states.py` | state-space layers' states at page boundaries: their namespace, keys and blocks |
| `connector_stats.py` | the sides' counters as vLLM's connector stats and Prometheus counters (`vllm:kvstore_*`) |

``kvstore.client.adapters.connection`` runs the asyncio client for these synchronous hooks.
"""

from kvstore.client.adapters.vllm.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]
