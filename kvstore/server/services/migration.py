"""The Migration servicer (DESIGN §12.8): thin adapters over the session
owner records here (session_owners.py), etcd's (server/cluster/migrations.py), the token log and
the replica fetch path. Each handler validates everything before it changes anything. Adopt
also has etcd told, in the background, that the version was adopted (the source's log may then go).

Who calls what: the migrating client (client/migrate.py) calls Copy, Adopt at the target and
Fence, Abort at the source, each as the session's tenant, on its own namespace; another
tenant's call finds no session (as for one that does not exist), never another tenant's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from kvstore import validate
from kvstore._proto import migration_pb2, migration_pb2_grpc
from kvstore.config import ServerConfig
from kvstore.errors import InvalidRequest, PermissionDenied, SessionFenced
from kvstore.security.identity import Identity, Rights
from kvstore.security.interceptor import current_identity
from kvstore.server.placement import Placement
from kvstore.server.services.handoffs import node_id
from kvstore.server.services.rpc_errors import unary
from kvstore.server.services.session_log import MAX_APPEND_TOKENS
from kvstore.server.session_owners import FENCED, FREEZING, INCOMING, OWNED, Ownership, SessionOwners
from kvstore.server.tenancy import Tenancy
from kvstore.server.tenancy.fetch_room import quota_landing
from kvstore.server.tenancy.node_calls import on_behalf
from kvstore.server.tokenlog import TokenLog

if TYPE_CHECKING:
    from kvstore.server.cluster import ClusterRuntime
    from kvstore.server.cluster.migrations import SessionMoves


class MigrationService(migration_pb2_grpc.MigrationServicer):
    def __init__(self, core: Placement, config: ServerConfig, tenancy: Tenancy, wal: TokenLog, owners: SessionOwners,
                 cluster: ClusterRuntime | None, moves: SessionMoves | None) -> None:
        self.core = core
        self.config = config
        self.tenancy = tenancy
        self.wal = wal
        self.owners = owners
        self.cluster = cluster
        self.moves = moves
        self.node = config.node
        self.metrics = core.metrics
        self.fences = core.metrics.session_fences

    # -- checks ------------------------------------------------------------------------------
    def _session(self, who: Identity, namespace_id: bytes, session_id: str) -> None:
        """The caller's own session: the write right, and a namespace that is no other tenant's here
        (unbound at a target the tenant never wrote to); PermissionDenied otherwise, as an append's."""
        if not who.allows(Rights.WRITE):
            raise PermissionDenied(f"tenant {who.tenant!r} lacks the write right (a migration moves a session's writes)")
        TokenLog._sid(namespace_id, session_id)  # InvalidRequest for a bad id
        owner = self.tenancy.owners.owner(namespace_id)
        if who.via != "local" and not who.allows(Rights.ADMIN) and owner not in (None, who.tenant):
            raise PermissionDenied(f"namespace {namespace_id.hex()} is another tenant's")

    def _moves(self) -> SessionMoves:
        if self.moves is None:
            raise InvalidRequest("live migration needs cluster mode (--cluster)")
        return self.moves

    @staticmethod
    def _tokens(values: list[int]) -> list[int]:
        if len(values) > MAX_APPEND_TOKENS:
            raise InvalidRequest(f"too many tokens: {len(values)} (at most {MAX_APPEND_TOKENS})")
        return list(values)

    def _log(self, who: Identity, namespace_id: bytes, session_id: str, prompt_tokens: int, tokens: list[int]) -> int:
        """Replaces this node's log of the session with ``tokens`` (charged to the tenant's quota)."""
        if prompt_tokens > len(tokens):
            raise InvalidRequest(f"prompt_tokens {prompt_tokens} > the {len(tokens)} tokens given")
        self.wal.end(namespace_id, session_id)
        with self.tenancy.writing(who, namespace_id), self.tenancy.quotas.appending(who) as charge:
            return self.wal.append(namespace_id, session_id, 0, tokens, prompt_tokens, True, charge)

    # -- target side ---------------------------------------------------------------------------
    @unary
    def Copy(self, request: migration_pb2.CopySessionRequest, context: grpc.ServicerContext) -> migration_pb2.CopySessionResponse:
        ns = validate.namespace_id(request.namespace_id)
        source = node_id(request.source, "source")
        keys = validate.keys(list(request.keys), self.config.max_pages_per_request, allow_empty=True)
        tokens = self._tokens(list(request.tokens))
        who = current_identity()
        self._session(who, ns, request.session_id)
        self._moves()
        if not source or source == self.node or (keys and request.page_bytes <= 0):
            raise InvalidRequest("Migration.Copy needs the source (another node) and page_bytes")
        assert self.cluster is not None
        mine = self.owners.get(ns, request.session_id)
        # the log copy so far, also at a node the session left earlier (migrated back); OWNED here: left alone
        if mine is None or mine.state == INCOMING or (mine.state == FENCED and request.version >= mine.version):
            if mine != Ownership(request.version, INCOMING, source):
                self.owners.put(ns, request.session_id, Ownership(request.version, INCOMING, source))
            held = self.wal.read(ns, request.session_id)
            if held is None or len(held[1]) < len(tokens):
                self._log(who, ns, request.session_id, request.prompt_tokens, tokens)
        return migration_pb2.CopySessionResponse(num_pages=self._copy(who, ns, source, keys, request.page_bytes, context))

    def _copy(self, who: Identity, ns: bytes, source: str, keys: list[bytes], page_bytes: int, context: grpc.ServicerContext) -> int:
        """As a replica (Data.Replicate with a holder): within the tenant's host quota here (fetch_room.py)."""
        assert self.cluster is not None
        have = self.cluster.remote.local_prefix(ns, keys) if keys else 0
        if have == len(keys):
            return have
        claimed = self.tenancy.claim(who, ns)
        held = 0
        try:
            held = self.cluster.copy_from(source, ns, keys, page_bytes, context.time_remaining(), on_behalf(who),
                                          quota_landing(self.tenancy.quotas, self.core, who, ns, keys))
        finally:
            if claimed:
                self.tenancy.settle(who, ns, held > 0)
        return held

    @unary
    def Adopt(self, request: migration_pb2.AdoptSessionRequest, context: grpc.ServicerContext) -> migration_pb2.AdoptSessionResponse:
        ns = validate.namespace_id(request.namespace_id)
        source = node_id(request.source, "source")
        tokens = self._tokens(list(request.tokens))
        who = current_identity()
        self._session(who, ns, request.session_id)
        moves = self._moves()
        sid = request.session_id
        mine = self.owners.get(ns, sid)
        if request.force:
            if mine is None or mine.state != INCOMING or mine.node != source:
                raise InvalidRequest(f"no copy of session {sid!r} from node {source!r} here to take over")
            if moves.is_member(source):
                raise SessionFenced(f"node {source} is a member (it may be serving the session): fence it there, or "
                                    "take over once it is gone")
            decided = moves.decide(ns, sid, mine.version + 1, self.node)
            if decided.owner != self.node or decided.version != mine.version + 1:
                raise SessionFenced(f"session {sid!r}: version {decided.version} was decided for node {decided.owner}")
            self.fences.labels("takeover").inc()
        else:
            record = moves.read(ns, sid)
            if record is None or record.owner != self.node or record.version != request.version:
                held = f"version {record.version} for node {record.owner}" if record else "no record"
                raise SessionFenced(f"session {sid!r}: etcd holds {held}, not version {request.version} for {self.node}")
            if not (mine is not None and mine.state == OWNED and mine.version == request.version):
                self._log(who, ns, sid, request.prompt_tokens, tokens)
            decided = record
        if not (mine is not None and mine.state == OWNED and mine.version == decided.version):
            self.owners.put(ns, sid, Ownership(decided.version, OWNED, self.node))
        if not decided.adopted:  # the source keeps its log until etcd says so (told in the background)
            moves.adopted(ns, sid, decided.version)
        logged = self.wal.read(ns, sid)
        return migration_pb2.AdoptSessionResponse(version=decided.version, num_tokens=len(logged[1]) if logged else 0)

    # -- source side ---------------------------------------------------------------------------
    @unary
    def Fence(self, request: migration_pb2.FenceSessionRequest, context: grpc.ServicerContext) -> migration_pb2.FenceSessionResponse:
        ns = validate.namespace_id(request.namespace_id)
        to_node = node_id(request.to_node, "to_node")
        who = current_identity()
        sid = request.session_id
        self._session(who, ns, sid)
        if not to_node or to_node == self.node:
            raise InvalidRequest("Migration.Fence needs to_node, another node")
        moves = self._moves()
        if self.wal.read(ns, sid) is None:
            raise InvalidRequest(f"no session {sid!r} of this namespace at node {self.node}")
        mine = self.owners.get(ns, sid)
        if mine is not None and mine.state == FENCED and mine.node == to_node:
            return self._fenced(ns, sid, mine.version)  # a resumed migration
        if mine is not None and (mine.state in (FENCED, INCOMING) or (mine.state == FREEZING and mine.node != to_node)):
            self.owners.check(ns, sid, "Fence")  # raises SessionFenced, naming the owner
        base = mine.version if mine is not None else 0
        with self.owners.writing(ns, sid):  # no append of the session is between its check and its write now
            # only with its log here (it may have idled out since the read above): FREEZING keeps it from then on
            self.owners.put(ns, sid, Ownership(base, FREEZING, to_node), logged=True)
        decided = moves.decide(ns, sid, base + 1, to_node)  # unreachable etcd: UNAVAILABLE, FREEZING stays (resume or abort)
        if decided.owner == to_node and decided.version == base + 1:
            self.owners.put(ns, sid, Ownership(decided.version, FENCED, to_node))
            self.fences.labels("fence").inc()
            return self._fenced(ns, sid, decided.version)
        state = OWNED if decided.owner == self.node else FENCED
        self.owners.put(ns, sid, Ownership(decided.version, state, decided.owner))
        raise SessionFenced(f"session {sid!r}: version {decided.version} was decided for node {decided.owner} "
                            "(an abort, or another migration)")

    def _fenced(self, ns: bytes, sid: str, version: int) -> migration_pb2.FenceSessionResponse:
        logged = self.wal.read(ns, sid)
        prompt, tokens = logged if logged is not None else (0, [])
        return migration_pb2.FenceSessionResponse(version=version, prompt_tokens=prompt, tokens=tokens)

    @unary
    def Abort(self, request: migration_pb2.AbortSessionRequest, context: grpc.ServicerContext) -> migration_pb2.AbortSessionResponse:
        ns = validate.namespace_id(request.namespace_id)
        who = current_identity()
        sid = request.session_id
        self._session(who, ns, sid)
        mine = self.owners.get(ns, sid)
        if mine is None or mine.state == OWNED:
            return migration_pb2.AbortSessionResponse(version=mine.version if mine else 0)
        if mine.state == FENCED:
            raise SessionFenced(f"session {sid!r} was fenced: node {mine.node} owns version {mine.version}; migrate it back")
        moves = self._moves()
        if mine.state == FREEZING:
            decided = moves.decide(ns, sid, mine.version + 1, self.node)
            state = OWNED if decided.owner == self.node else FENCED
            self.owners.put(ns, sid, Ownership(decided.version, state, decided.owner))
            if state == FENCED:
                raise SessionFenced(f"session {sid!r}: the fence was decided, node {decided.owner} owns version "
                                    f"{decided.version}")
            self.fences.labels("abort").inc()
            return migration_pb2.AbortSessionResponse(version=decided.version)
        record = moves.read(ns, sid)  # INCOMING, at the target
        if record is not None and record.owner == self.node and record.version > mine.version:
            raise SessionFenced(f"session {sid!r}: version {record.version} was decided for this node; adopt it")
        if record is not None and record.owner != self.node:  # the session was here before and moved: still fenced here
            self.owners.put(ns, sid, Ownership(record.version, FENCED, record.owner))
        else:
            self.owners.drop(ns, sid)
        self.wal.end(ns, sid)
        return migration_pb2.AbortSessionResponse(version=mine.version)

    @unary
    def Status(self, request: migration_pb2.SessionStatusRequest,
               context: grpc.ServicerContext) -> migration_pb2.SessionStatusResponse:
        ns = validate.namespace_id(request.namespace_id)
        to_node = node_id(request.to_node, "to_node")
        who = current_identity()
        TokenLog._sid(ns, request.session_id)
        if not self.tenancy.may_read(who, ns):
            return migration_pb2.SessionStatusResponse(node=self.node)
        mine = self.owners.get(ns, request.session_id)
        answer = migration_pb2.SessionStatusResponse(node=self.node, version=mine.version if mine else 0,
                                                     state=mine.state_name if mine else "",
                                                     owner=(self.node if mine.state in (OWNED, FREEZING) else mine.node)
                                                     if mine else "")
        if self.moves is not None:
            record = self.moves.read(ns, request.session_id)
            if record is not None:
                answer.cluster_version, answer.cluster_owner = record.version, record.owner
            answer.to_address = self.moves.address_of(to_node) if to_node else ""
        return answer
