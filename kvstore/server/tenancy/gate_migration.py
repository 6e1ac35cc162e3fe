"""The tenancy gate's live-migration operations (DESIGN §12.8: Copy, Adopt, Fence, Abort, Status):
a mixin of ``Gate`` (gate.py). Each checks the caller's own session first, then moves the session's
owner records here (session_owners.py) and etcd's (server/cluster/migrations.py); another tenant's
call finds no session, as for one that does not exist."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import InvalidRequest, PermissionDenied, SessionFenced
from kvstore.security.identity import Identity, Rights
from kvstore.server.placement import Placement
from kvstore.server.session_owners import FENCED, FREEZING, INCOMING, OWNED, Ownership, SessionOwners
from kvstore.server.tenancy.access import Tenancy
from kvstore.server.tenancy.fetch_room import quota_landing
from kvstore.server.tenancy.node_calls import on_behalf
from kvstore.server.tenancy.room import CallContext
from kvstore.server.tokenlog import TokenLog

if TYPE_CHECKING:  # cluster mode is imported only when the server runs it
    from kvstore.server.cluster import ClusterRuntime
    from kvstore.server.cluster.migrations import SessionMoves


@dataclass(frozen=True)
class SessionStatus:
    """What Migration.Status answers; all empty for a namespace the caller may not read."""

    version: int = 0
    state: str = ""
    owner: str = ""
    cluster_version: int = 0
    cluster_owner: str = ""
    to_address: str = ""


class MigrationGate:
    """Needs ``core``, ``tenancy``, ``cluster``, ``wal``, ``session_owners`` and ``moves`` of the gate it is mixed into."""

    core: Placement
    tenancy: Tenancy
    cluster: ClusterRuntime | None
    wal: TokenLog | None
    session_owners: SessionOwners
    moves: SessionMoves | None

    @property
    def _wal(self) -> TokenLog:
        assert self.wal is not None, "the server builds the gate with its token log"
        return self.wal

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

    def _log(self, who: Identity, namespace_id: bytes, session_id: str, prompt_tokens: int, tokens: list[int]) -> int:
        """Replaces this node's log of the session with ``tokens`` (charged to the tenant's quota)."""
        if prompt_tokens > len(tokens):
            raise InvalidRequest(f"prompt_tokens {prompt_tokens} > the {len(tokens)} tokens given")
        self._wal.end(namespace_id, session_id)
        with self.tenancy.writing(who, namespace_id), self.tenancy.quotas.appending(who) as charge:
            return self._wal.append(namespace_id, session_id, 0, tokens, prompt_tokens, True, charge)

    def copy_session(self, who: Identity, ns: bytes, sid: str, source: str, version: int, keys: list[bytes], page_bytes: int,
                     prompt_tokens: int, tokens: list[int], context: CallContext) -> int:
        """At the target: the log copied so far, then the pages (as a replica, within the host quota)."""
        self._session(who, ns, sid)
        self._moves()
        if not source or source == self.core.node or (keys and page_bytes <= 0):
            raise InvalidRequest("Migration.Copy needs the source (another node) and page_bytes")
        owners = self.session_owners
        mine = owners.get(ns, sid)
        # the log copy so far, also at a node the session left earlier (migrated back); OWNED here: left alone
        if mine is None or mine.state == INCOMING or (mine.state == FENCED and version >= mine.version):
            if mine != Ownership(version, INCOMING, source):
                owners.put(ns, sid, Ownership(version, INCOMING, source))
            held = self._wal.read(ns, sid)
            if held is None or len(held[1]) < len(tokens):
                self._log(who, ns, sid, prompt_tokens, tokens)
        return self._copy_pages(who, ns, source, keys, page_bytes, context)

    def _copy_pages(self, who: Identity, ns: bytes, source: str, keys: list[bytes], page_bytes: int, context: CallContext) -> int:
        """As a replica (Data.Replicate with a holder): within the tenant's host quota here (fetch_room.py)."""
        assert self.cluster is not None
        have = self.cluster.remote.checked_prefix(ns, keys) if keys else 0  # a copy landed unhashed counts once checked
        if have == len(keys):
            return have
        remote = self.cluster.remote
        with self.tenancy.copying(who, ns, lambda: remote.local_prefix(ns, keys)):  # also if the copy raised
            return self.cluster.copy_from(source, ns, keys, page_bytes, context.time_remaining(), on_behalf(who),
                                          quota_landing(self.tenancy.quotas, self.core, who, ns, keys))

    def adopt(self, who: Identity, ns: bytes, sid: str, source: str, version: int, force: bool, prompt_tokens: int,
              tokens: list[int]) -> tuple[int, int]:
        """At the target: the session owned here at the version etcd decided (``force``: taken
        over from a source that is gone); returns that version and the tokens logged here."""
        self._session(who, ns, sid)
        moves = self._moves()
        node, owners = self.core.node, self.session_owners
        mine = owners.get(ns, sid)
        if force:
            if mine is None or mine.state != INCOMING or mine.node != source:
                raise InvalidRequest(f"no copy of session {sid!r} from node {source!r} here to take over")
            if moves.is_member(source):
                raise SessionFenced(f"node {source} is a member (it may be serving the session): fence it there, or "
                                    "take over once it is gone")
            decided = moves.decide(ns, sid, mine.version + 1, node)
            if decided.owner != node or decided.version != mine.version + 1:
                raise SessionFenced(f"session {sid!r}: version {decided.version} was decided for node {decided.owner}")
            self.core.metrics.session_fences.labels("takeover").inc()
        else:
            record = moves.read(ns, sid)
            if record is None or record.owner != node or record.version != version:
                held = f"version {record.version} for node {record.owner}" if record else "no record"
                raise SessionFenced(f"session {sid!r}: etcd holds {held}, not version {version} for {node}")
            if not (mine is not None and mine.state == OWNED and mine.version == version):
                self._log(who, ns, sid, prompt_tokens, tokens)
            decided = record
        if not (mine is not None and mine.state == OWNED and mine.version == decided.version):
            owners.put(ns, sid, Ownership(decided.version, OWNED, node))
        if not decided.adopted:  # the source keeps its log until etcd says so (told in the background)
            moves.adopted(ns, sid, decided.version)
        logged = self._wal.read(ns, sid)
        return decided.version, len(logged[1]) if logged else 0

    def fence(self, who: Identity, ns: bytes, sid: str, to_node: str) -> tuple[int, int, list[int]]:
        """At the source: the session fenced for ``to_node``; returns the version decided and the
        log (prompt tokens, tokens) as it is now, complete since no append passes the fence."""
        self._session(who, ns, sid)
        node, owners = self.core.node, self.session_owners
        if not to_node or to_node == node:
            raise InvalidRequest("Migration.Fence needs to_node, another node")
        moves = self._moves()
        if self._wal.read(ns, sid) is None:
            raise InvalidRequest(f"no session {sid!r} of this namespace at node {node}")
        mine = owners.get(ns, sid)
        if mine is not None and mine.state == FENCED and mine.node == to_node:
            return self._fenced(ns, sid, mine.version)  # a resumed migration
        if mine is not None and (mine.state in (FENCED, INCOMING) or (mine.state == FREEZING and mine.node != to_node)):
            owners.check(ns, sid, "Fence")  # raises SessionFenced, naming the owner
        base = mine.version if mine is not None else 0
        with owners.writing(ns, sid):  # no append of the session is between its check and its write now
            # only with its log here (it may have idled out since the read above): FREEZING keeps it from then on
            owners.put(ns, sid, Ownership(base, FREEZING, to_node), logged=True)
        decided = moves.decide(ns, sid, base + 1, to_node)  # unreachable etcd: UNAVAILABLE, FREEZING stays (resume or abort)
        if decided.owner == to_node and decided.version == base + 1:
            owners.put(ns, sid, Ownership(decided.version, FENCED, to_node))
            self.core.metrics.session_fences.labels("fence").inc()
            return self._fenced(ns, sid, decided.version)
        state = OWNED if decided.owner == node else FENCED
        owners.put(ns, sid, Ownership(decided.version, state, decided.owner))
        raise SessionFenced(f"session {sid!r}: version {decided.version} was decided for node {decided.owner} "
                            "(an abort, or another migration)")

    def _fenced(self, ns: bytes, sid: str, version: int) -> tuple[int, int, list[int]]:
        logged = self._wal.read(ns, sid)
        prompt, tokens = logged if logged is not None else (0, [])
        return version, prompt, tokens

    def abort_move(self, who: Identity, ns: bytes, sid: str) -> int:
        """A migration given up, at either side; returns the session's version here."""
        self._session(who, ns, sid)
        node, owners = self.core.node, self.session_owners
        mine = owners.get(ns, sid)
        if mine is None or mine.state == OWNED:
            return mine.version if mine else 0
        if mine.state == FENCED:
            raise SessionFenced(f"session {sid!r} was fenced: node {mine.node} owns version {mine.version}; migrate it back")
        moves = self._moves()
        if mine.state == FREEZING:
            decided = moves.decide(ns, sid, mine.version + 1, node)
            state = OWNED if decided.owner == node else FENCED
            owners.put(ns, sid, Ownership(decided.version, state, decided.owner))
            if state == FENCED:
                raise SessionFenced(f"session {sid!r}: the fence was decided, node {decided.owner} owns version "
                                    f"{decided.version}")
            self.core.metrics.session_fences.labels("abort").inc()
            return decided.version
        record = moves.read(ns, sid)  # INCOMING, at the target
        if record is not None and record.owner == node and record.version > mine.version:
            raise SessionFenced(f"session {sid!r}: version {record.version} was decided for this node; adopt it")
        if record is not None and record.owner != node:  # the session was here before and moved: still fenced here
            owners.put(ns, sid, Ownership(record.version, FENCED, record.owner))
        else:
            owners.drop(ns, sid)
        self._wal.end(ns, sid)
        return mine.version

    def session_status(self, who: Identity, ns: bytes, sid: str, to_node: str) -> SessionStatus:
        """The session's owner record here and etcd's, for a caller that may read the namespace."""
        TokenLog._sid(ns, sid)
        if not self.tenancy.may_read(who, ns):
            return SessionStatus()
        mine = self.session_owners.get(ns, sid)
        record = self.moves.read(ns, sid) if self.moves is not None else None
        return SessionStatus(
            version=mine.version if mine else 0, state=mine.state_name if mine else "",
            owner=(self.core.node if mine.state in (OWNED, FREEZING) else mine.node) if mine else "",
            cluster_version=record.version if record is not None else 0, cluster_owner=record.owner if record is not None else "",
            to_address=self.moves.address_of(to_node) if self.moves is not None and to_node else "")
