"""The Migration servicer (DESIGN §12.8): thin adapters over the tenancy gate's migration
operations (tenancy/gate_migration.py: the session owner records here, etcd's, the token log and
the replica fetch path). Each handler validates everything before it changes anything. Adopt
also has etcd told, in the background, that the version was adopted (the source's log may then go).

Who calls what: the migrating client (client/migrate.py) calls Copy, Adopt at the target and
Fence, Abort at the source, each as the session's tenant, on its own namespace; another
tenant's call finds no session (as for one that does not exist), never another tenant's.
"""

from __future__ import annotations

import grpc

from kvstore import validate
from kvstore._proto import migration_pb2, migration_pb2_grpc
from kvstore.config import ServerConfig
from kvstore.errors import InvalidRequest
from kvstore.security.interceptor import current_identity
from kvstore.server.placement import Placement
from kvstore.server.services.handoffs import node_id
from kvstore.server.services.rpc_errors import unary
from kvstore.server.services.session_log import MAX_APPEND_TOKENS
from kvstore.server.tenancy.gate import Gate


def tokens_of(values: list[int]) -> list[int]:
    if len(values) > MAX_APPEND_TOKENS:
        raise InvalidRequest(f"too many tokens: {len(values)} (at most {MAX_APPEND_TOKENS})")
    return list(values)


class MigrationService(migration_pb2_grpc.MigrationServicer):
    """Each handler validates its request, makes one call of the tenancy gate (tenancy/gate_migration.py:
    the caller's own session checked first) and answers; exceptions become statuses in rpc_errors.py."""

    def __init__(self, core: Placement, config: ServerConfig, gate: Gate) -> None:
        self.core = core
        self.config = config
        self.gate = gate
        self.metrics = core.metrics

    # -- target side ---------------------------------------------------------------------------
    @unary
    def Copy(self, request: migration_pb2.CopySessionRequest, context: grpc.ServicerContext) -> migration_pb2.CopySessionResponse:
        ns = validate.namespace_id(request.namespace_id)
        source = node_id(request.source, "source")
        keys = validate.keys(list(request.keys), self.config.max_pages_per_request, allow_empty=True)
        tokens = tokens_of(list(request.tokens))
        n = self.gate.copy_session(current_identity(), ns, request.session_id, source, request.version, keys, request.page_bytes,
                                   request.prompt_tokens, tokens, context)
        return migration_pb2.CopySessionResponse(num_pages=n)

    @unary
    def Adopt(self, request: migration_pb2.AdoptSessionRequest, context: grpc.ServicerContext) -> migration_pb2.AdoptSessionResponse:
        ns = validate.namespace_id(request.namespace_id)
        source = node_id(request.source, "source")
        tokens = tokens_of(list(request.tokens))
        version, num_tokens = self.gate.adopt(current_identity(), ns, request.session_id, source, request.version, request.force,
                                              request.prompt_tokens, tokens)
        return migration_pb2.AdoptSessionResponse(version=version, num_tokens=num_tokens)

    # -- source side ---------------------------------------------------------------------------
    @unary
    def Fence(self, request: migration_pb2.FenceSessionRequest, context: grpc.ServicerContext) -> migration_pb2.FenceSessionResponse:
        ns = validate.namespace_id(request.namespace_id)
        to_node = node_id(request.to_node, "to_node")
        version, prompt, tokens = self.gate.fence(current_identity(), ns, request.session_id, to_node)
        return migration_pb2.FenceSessionResponse(version=version, prompt_tokens=prompt, tokens=tokens)

    @unary
    def Abort(self, request: migration_pb2.AbortSessionRequest, context: grpc.ServicerContext) -> migration_pb2.AbortSessionResponse:
        ns = validate.namespace_id(request.namespace_id)
        return migration_pb2.AbortSessionResponse(version=self.gate.abort_move(current_identity(), ns, request.session_id))

    @unary
    def Status(self, request: migration_pb2.SessionStatusRequest,
               context: grpc.ServicerContext) -> migration_pb2.SessionStatusResponse:
        ns = validate.namespace_id(request.namespace_id)
        to_node = node_id(request.to_node, "to_node")
        st = self.gate.session_status(current_identity(), ns, request.session_id, to_node)
        return migration_pb2.SessionStatusResponse(
            node=self.core.node, version=st.version, state=st.state, owner=st.owner, cluster_version=st.cluster_version,
            cluster_owner=st.cluster_owner, to_address=st.to_address)
