"""The connector's configuration and the kvstore namespace of a vLLM engine.

Nothing here imports vLLM: the engine's config objects are read by attribute, so this
module is testable and importable where vLLM is not installed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvstore.client.adapters.vllm.groups import KVGroups
from kvstore.errors import ConfigError
from kvstore.security.credentials import ClientSecurity, Credentials
from kvstore.types import KVLayout, Namespace

ADDRESS_ENV = "KVSTORE_ADDRESS"
AUTO = "auto"  # handoff_push_layers decided by where vLLM's KV lives (pd_worker.HandoffWorker.register)


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` may set. Unknown keys are refused by name.

    * ``address``: the kvstore-server (default: ``$KVSTORE_ADDRESS``).
    * ``page_tokens``: tokens per kvstore page; must divide vLLM's block size (default:
      the block size, one page per block).
    * ``lookup_timeout_s``: the most the scheduler waits for a lookup before it treats the
      request as a miss (the engine never stalls on a dead store).
    * ``load_deadline_s``: the most a layer-wise load may hold up the forward pass before
      its blocks are reported failed and vLLM recomputes them (default: twice the
      measured cost of recomputing them, see ``load_when_faster``; at least 50 ms).
    * ``load_ahead``: layers loaded before compute starts (default: the client's estimate).
    * ``sync_load_pages``: hits of at most this many pages, leased by the lookup on the
      server's host, are copied at once before the forward pass (no further RPC); longer
      ones load layer by layer behind compute.
    * ``revision``: the weights revision in the namespace (default: vLLM's ``revision``).
      Two engines share pages only with equal model, revision, layout and TP shard.
    * ``tenant_salt``: separates engines sharing a server without tenants. Leave it empty
      with a token: the server gives each tenant its own salt, folded in at connect.
    * ``token``, ``token_file``: the bearer token of a server with ``--auth-file`` (default:
      ``$KVSTORE_TOKEN``, then the file ``$KVSTORE_TOKEN_FILE``); a token the server refuses
      fails the engine's start. ``tls_ca``, ``tls_cert``, ``tls_key``, ``tls_server_name``:
      TLS to a server with ``--tls-cert`` (a token goes only over TLS or to a loopback
      address). ``credentials`` holds what they resolve to.
    * ``use_shm``: move page bytes through the server's shared arena when on its host.
    * ``use_call_socket``: make the hit path's calls (lookup+lease, release) over the
      server's same-host call socket when it offers one (kvstore/callsocket/frames.py), not gRPC.
    * ``retry_s``: how long after a failed connection the next attempt is made.
    * ``load_when_faster``: load a hit only when fetching it is measured to cost less than
      recomputing it (the connector's cost model: its loads' and the engine's steps' times);
      False loads every hit.
    * ``handoff_deadline_s``: disaggregated prefill (pd.py): how long a decode instance waits
      for a handoff's completion marker before it recomputes the prompt (a request's
      ``kv_transfer_params`` may set ``kvstore_deadline_s``); also the most a prefill waits
      for its handoff's completion while it holds the request's blocks (the decode side has
      given up by then). ``handoff_ttl_s``: how long the store keeps a handoff a prefill
      opened and nobody consumed. ``handoff_push_layers``: a prefill's layers go to the
      decode node while its later layers compute (DESIGN §12.7); False: each page goes once
      stored; "auto" (the default): True where vLLM's KV is on an accelerator, False where
      the engine computes on the CPU, whose cores the pushes would take from the prefill.
    """

    address: str
    page_tokens: int | None = None
    lookup_timeout_s: float = 0.25
    load_deadline_s: float | None = None
    load_ahead: int | None = None
    sync_load_pages: int = 4
    revision: str | None = None
    tenant_salt: str = ""
    use_shm: bool = True
    use_call_socket: bool = True
    retry_s: float = 1.0
    load_when_faster: bool = True
    handoff_deadline_s: float = 10.0
    handoff_ttl_s: float = 30.0
    handoff_push_layers: bool | str = AUTO
    credentials: Credentials = field(default_factory=Credentials)

    def __post_init__(self) -> None:
        if not self.address:
            raise ConfigError(f'kv_connector_extra_config needs "address" (or set {ADDRESS_ENV})')
        if self.page_tokens is not None and (not isinstance(self.page_tokens, int) or self.page_tokens <= 0):
            raise ConfigError(f'kv_connector_extra_config "page_tokens" must be a positive integer, got {self.page_tokens!r}')
        for name in ("lookup_timeout_s", "retry_s", "handoff_deadline_s", "handoff_ttl_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f'kv_connector_extra_config "{name}" must be > 0')
        if not isinstance(self.handoff_push_layers, bool) and self.handoff_push_layers != AUTO:
            raise ConfigError(f'kv_connector_extra_config "handoff_push_layers" must be true, false or "{AUTO}", '
                              f'got {self.handoff_push_layers!r}')
        if self.load_deadline_s is not None and self.load_deadline_s <= 0:
            raise ConfigError('kv_connector_extra_config "load_deadline_s" must be > 0')

    def push_layers(self) -> bool | None:
        """``handoff_push_layers`` for the worker: None when "auto" (decided at register)."""
        return None if self.handoff_push_layers == AUTO else bool(self.handoff_push_layers)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)} - {"credentials"} | ClientSecurity.keys()
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        security = ClientSecurity.pop_from(extra)
        extra.setdefault("address", environ.get(ADDRESS_ENV, ""))
        return cls(**extra, credentials=security.resolve(extra_option, environ))


def extra_option(name: str) -> str:
    """How an error names key ``name`` of the connector's config."""
    return f'kv_connector_extra_config "{name}"'


def kv_spec(kv_cache_config: Any) -> tuple[list[str], Any]:
    """The attention layer names in page order and the KV cache spec they share (see
    groups.py: every group's layers, group after group)."""
    groups = KVGroups.of(kv_cache_config)
    return groups.layer_names, groups.spec


def engine_namespace(vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, tp_rank: int = 0,
                     tp_size: int | None = None) -> Namespace:
    """The namespace of this engine's KV: model, revision, KV dtype and shape, page size
    and tensor-parallel shard. Pages are canonical (``[layer][K|V][token][head][dim]``),
    so engines on different attention backends share them. With several KV cache groups
    the group layout is part of it (KVLayout.groups)."""
    groups = KVGroups.of(kv_cache_config)
    layer_names, spec = groups.layer_names, groups.spec
    page_tokens = config.page_tokens or spec.block_size
    if spec.block_size % page_tokens:
        raise ConfigError(f'"page_tokens" {page_tokens} must divide vLLM\'s block size {spec.block_size}')
    layout = KVLayout(num_layers=len(layer_names), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                      dtype=spec.dtype, page_tokens=page_tokens, groups=groups.describe())
    model = vllm_config.model_config
    revision = config.revision if config.revision is not None else (model.revision or "")
    size = tp_size if tp_size is not None else vllm_config.parallel_config.tensor_parallel_size
    return Namespace(model=str(model.model), revision=revision, layout=layout, tp_rank=tp_rank, tp_size=size,
                     tenant_salt=config.tenant_salt)
