"""The tenancy gate in front of the placement core: each operation resolves its caller, reserves
its quota, calls the core and settles, so that the servicers only validate, call it and answer.

More: kvstore/server/tenancy/README.md (### gate.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore import validate
from kvstore.errors import InvalidRequest, LimitExceeded, PermissionDenied
from kvstore.page import LayoutDesc, checksum
from kvstore.security.identity import Identity, Rights
from kvstore.server.handoff_markers import HandoffMarkers
from kvstore.server.layer_landings import written_slots
from kvstore.server.leases import Allocation
from kvstore.server.placement import Placement
from kvstore.server.placement.reads import AcquiredPage
from kvstore.server.placement.reported import ReportBudget, check_reported
from kvstore.server.session_owners import SessionOwners
from kvstore.server.tenancy.access import Tenancy
from kvstore.server.tenancy.cluster_reads import ClusterReads
from kvstore.server.tenancy.fetch_room import quota_landing
from kvstore.server.tenancy.gate_arenas import ArenaGate, Mapped
from kvstore.server.tenancy.gate_directory import DirectoryGate
from kvstore.server.tenancy.gate_handoffs import HandoffGate
from kvstore.server.tenancy.gate_migration import MigrationGate
from kvstore.server.tenancy.node_calls import MAX_NODE_ID, acting_for, on_behalf, require_node
from kvstore.server.tenancy.owners import owner_for
from kvstore.server.tenancy.quotas import NOTHING, Reservation
from kvstore.server.tenancy.room import CallContext, room
from kvstore.server.tenancy.session_saves import committing
from kvstore.server.tokenlog import TokenLog

if TYPE_CHECKING:  # cluster mode is imported only when the server runs it
    from kvstore.server.cluster import ClusterRuntime
    from kvstore.server.cluster.migrations import SessionMoves

Slots = list[tuple[bytes, int | None]]
HintEntries = list[tuple[list[bytes], float]]


class Gate(DirectoryGate, HandoffGate, MigrationGate, ArenaGate):
    """``arena_socket`` set: each tenant has its own arena, fetched there (a slot only ever held its own pages).
    The directory's operations are in gate_directory.py, the handoffs' in gate_handoffs.py, live
    migration's in gate_migration.py, the memory a same-host caller maps in gate_arenas.py."""

    def __init__(self, core: Placement, tenancy: Tenancy, session_owners: SessionOwners, handoffs: HandoffMarkers | None = None,
                 cluster: ClusterRuntime | None = None, wal: TokenLog | None = None,
                 moves: SessionMoves | None = None, share_arena: bool = False, arena_socket: Path | None = None,
                 pool_socket: Path | None = None) -> None:
        self.core = core
        self.tenancy = tenancy
        self.quotas = tenancy.quotas
        self.session_owners = session_owners  # who owns each migrated session here (DESIGN §12.8)
        self.handoffs = handoffs  # a handoff's pages are let go once its waiter acquired them (DESIGN §12.7)
        self.cluster = cluster  # a ClusterRuntime in cluster mode: reads fetch pages other nodes hold
        self.cluster_reads = ClusterReads(tenancy, cluster) if cluster is not None else None
        self.wal = wal  # the token log: a migrated session's log
        self.moves = moves  # cluster mode: etcd's records of session moves (live migration)
        self.reports = ReportBudget()  # pages readers report failing, checked per owner (placement/reported.py)
        self.share_arena = share_arena  # --share-arena: one arena for every tenant
        self.arena_socket = arena_socket  # with an arena per tenant (only then): where a caller fetches its own
        self.pool_socket = pool_socket  # with hbm: where an engine fetches its tenant's pool

    def allocate(self, who: Identity, ns: bytes, layout: LayoutDesc, keys: list[bytes], parent: bytes | None,
                 generation: int | None, session_id: str,
                 context: CallContext) -> tuple[bytes, Slots, Allocation | None, bytes]:
        """Room at the tenant's host quota (room.py), the namespace claimed, the slots allocated;
        last, the token of the caller's arena they are in (empty: none, gate_arenas.py)."""
        if session_id and self.tenancy.sees(who, ns):  # a session fenced here (live migration): refused, to its tenant
            self.session_owners.check(ns, session_id, "Allocate")
        held = room(self.quotas, self.core, who, len(keys), layout.page_bytes, context, parent)
        claimed, heard = self.tenancy.claim(who, ns), False
        try:
            ident, slots = self.core.allocate(ns, layout, keys, owner_for(who.tenant), parent, self.quotas.handing_over(held),
                                              generation)
            heard = context.is_active()  # else its deadline passed while room was made: nobody hears of it (a gRPC caller)
            if not heard:
                self.core.abort(ident, owner_for(who.tenant))
        finally:
            held.release()  # handed over to the allocation's slots (or there are none)
            if claimed:
                self.tenancy.settle(who, ns, heard)  # bound only by an allocation its caller hears of
        alloc = self.core.leases.allocation(ident)
        if alloc is not None and session_id:  # kept for its Commit: refused if the session is fenced by then
            alloc.session_id = session_id
        return ident, slots, alloc, self._arena_token(who)

    def commit(self, who: Identity, allocation_id: bytes, keys: list[bytes], checksums: list[int], durable: bool,
               flags: int) -> int:
        """The slots' bytes stay counted while they become pages (ssd quotas: see ssd_share.py)."""
        alloc, owner = self.core.leases.allocation(allocation_id), owner_for(who.tenant)
        mine = alloc is not None and alloc.owner == owner
        bridge = NOTHING
        with committing(self.session_owners, self.core, allocation_id, alloc.namespace_id if alloc else b"",
                        alloc.session_id if mine and alloc else "", "Commit", owner):  # before the fence, or refused after
            if mine and alloc is not None and who.via != "local":
                self._check_written(allocation_id, alloc.slots, keys, checksums)
                bridge = self.quotas.hold(who, host_bytes=len(alloc.slots) * alloc.layout.page_bytes)
            try:
                return self.core.commit(allocation_id, keys, checksums, durable, flags, owner=owner,
                                        counting=self.quotas.handing_over(bridge))
            finally:
                bridge.release()

    def _check_written(self, allocation_id: bytes, slots: dict[bytes, int], keys: list[bytes], checksums: list[int]) -> None:
        """A tenant's commit is checked against the bytes in its slots: a freed slot keeps the
        bytes of the page that left it (maybe another tenant's), and a commit that claims a
        checksum without writing them must not publish those bytes under the caller's key. With
        an arena per tenant a slot only ever held the tenant's own pages: nothing to check (a
        page committed with a wrong checksum fails the checks before it is sent or demoted)."""
        if self.arena_socket is not None:  # an arena per tenant
            return
        for key, expected in zip(keys, checksums):
            if key in slots and checksum(self.core.slot_view(allocation_id, key)) != expected:
                raise InvalidRequest(f"page {key.hex()}: the checksum does not match the bytes in its slot; "
                                     "nothing was committed (write the page, then commit)")

    def open_group(self, who: Identity, ns: bytes, layout: LayoutDesc, keys: list[bytes], parent: bytes | None,
                   generation: int | None, session_id: str) -> tuple[bytes, Slots, bool]:
        """A WritePages group's slots (services/page_writes.py): room for as many of ``keys`` as the
        host quota makes, halving, the page alone's refusal raised; the namespace claimed (True:
        ``commit_group`` settles it). Returns the allocation, its slots and whether it claimed."""
        if session_id and self.tenancy.sees(who, ns):  # a session fenced here: refused before a slot is taken
            self.session_owners.check(ns, session_id, "WritePages")
        n, held = self._group_room(who, len(keys), layout.page_bytes, parent)
        try:
            claimed = self.tenancy.claim(who, ns)
            try:
                allocation_id, slots = self.core.allocate(ns, layout, keys[:n], owner_for(who.tenant), parent,
                                                          self.quotas.handing_over(held), generation)
            except BaseException:
                if claimed:
                    self.tenancy.settle(who, ns, False)
                raise
        finally:
            held.release()  # handed over to the allocation's slots (or there are none)
        return allocation_id, slots, claimed

    def _group_room(self, who: Identity, num_pages: int, page_bytes: int, parent: bytes | None) -> tuple[int, Reservation]:
        """Room for as many of ``num_pages`` as the tenant's host quota makes, halving; the page alone's refusal is raised."""
        while True:
            try:
                return num_pages, room(self.quotas, self.core, who, num_pages, page_bytes, parent=parent)
            except LimitExceeded:
                if num_pages == 1:
                    raise
                num_pages //= 2

    def commit_group(self, who: Identity, allocation_id: bytes, ns: bytes, session_id: str, verified: list[bytes],
                     checksums: list[int], durable: bool, flags: int, written_bytes: int, claimed: bool) -> int:
        """Commits a group's ``verified`` pages (its other slots freed; none: aborted) within its
        session's fence; the slots' ``written_bytes`` stay counted while they become pages. Any
        failure aborts the allocation (LeaseExpired too, raised as it is); the claim is settled."""
        if not verified:
            self.core.abort(allocation_id)
            if claimed:
                self.tenancy.settle(who, ns, False)
            return 0
        n = 0
        bridge = self.quotas.hold(who, host_bytes=written_bytes) if written_bytes else NOTHING
        try:
            with committing(self.session_owners, self.core, allocation_id, ns, session_id, "WritePages"):
                n = min(len(verified), self.core.commit(allocation_id, verified, checksums, durable, flags,
                                                        counting=self.quotas.handing_over(bridge)))
        except BaseException:
            self.core.abort(allocation_id)  # a no-op unless the commit failed before taking it
            raise
        finally:
            bridge.release()
            if claimed:
                self.tenancy.settle(who, ns, n > 0)
        return n

    def acquire(self, who: Identity, ns: bytes, keys: list[bytes], ttl_ms: int, context: CallContext,
                device: bool = False) -> Mapped:
        """A lease on what the caller may read of ``keys`` (nothing: as for an empty namespace), in
        its own arena and, with ``device``, copied to its own pool where it may map it (gate_arenas.py)."""
        self._check_arena(who, ns)
        device = self._to_device(who, device)
        generation = self.core.directory.generation(ns)  # before the pages: leased pages are never of an older one
        ident, pages = self._acquire(who, ns, keys, ttl_ms, context, device, node_call=False)
        try:
            return dataclasses.replace(self._mapped(who, ident, pages, device), generation=generation)
        except BaseException:  # its own arena could not be made (TierFull): a refused call holds no lease (DESIGN §11)
            self.core.release(ident, owner_for(who.tenant))
            raise

    def read(self, who: Identity, ns: bytes, keys: list[bytes], ttl_ms: int, context: CallContext, local_only: bool,
             tenant: str, generation: int | None) -> tuple[bytes, list[AcquiredPage]]:
        """ReadPages' lease. With ``local_only`` or ``tenant`` (the node right): a node fetching for
        one of its tenants, its ``generation`` (unvalidated) entered here or refused when older."""
        node_call = local_only or bool(tenant)
        if node_call:
            require_node(who, "ReadPages with local_only or tenant")
            who = acting_for(who, tenant)
            if generation is not None:  # the reader's: a newer one is entered here, an older one refused
                self.core.read_generation(ns, validate.generation(generation))
        return self._acquire(who, ns, keys, ttl_ms, context, False, node_call)

    def _acquire(self, who: Identity, ns: bytes, keys: list[bytes], ttl_ms: int, context: CallContext, device: bool,
                 node_call: bool) -> tuple[bytes, list[AcquiredPage]]:
        with self.quotas.reserving(who, leases=1):
            if not (self.tenancy.may_read(who, ns) if node_call else self._readable(who, ns, keys, context)):
                keys = []  # as for an empty namespace
            ident, pages = self.core.acquire(ns, keys, ttl_ms, owner=owner_for(who.tenant), device=device)
        self.quotas.used(who, [p.key for p in pages])
        if self.handoffs is not None and not node_call:
            self.handoffs.acquired(who.tenant, ns, [p.key for p in pages])
        return ident, pages

    def abort(self, who: Identity, allocation_id: bytes) -> None:
        """Gives back the caller's allocation (another's is unknown to it: a no-op)."""
        self.core.abort(allocation_id, owner_for(who.tenant))

    def release(self, who: Identity, lease_id: bytes, failed: Sequence[bytes] = ()) -> None:
        """Ends the caller's lease (another's is unknown to it). The pages its reader found failing
        (``failed``) are checked first where the lease holds them, within the caller's budget."""
        owner = owner_for(who.tenant)
        if failed:
            check_reported(self.core, lease_id, owner, list(failed), lambda: self.reports.take(owner))
        self.core.release(lease_id, owner)

    def renew(self, who: Identity, handle: bytes, ttl_ms: int, layers_written: int = 0) -> None:
        """Moves the caller's lease's or allocation's expiry on (LeaseExpired: not the caller's, or gone);
        ``layers_written``: an allocation's leading layers its writer stored, pushed on to the decode
        node of a direct handoff open here that names its pages (DESIGN §12.7; not waited for)."""
        owner = owner_for(who.tenant)
        self.core.renew(handle, ttl_ms, owner)
        if layers_written and self.cluster is not None and (slots := written_slots(self.core, handle, owner)) is not None:
            self.cluster.submit(self.cluster.handoffs.layers_written(on_behalf(who), handle, slots, layers_written))

    def _readable(self, who: Identity, ns: bytes, keys: list[bytes], context: CallContext) -> bool:
        """Whether ``who`` may read the namespace; in cluster mode, after fetching what other
        nodes hold of ``keys`` into this node's host tier (cluster_reads.py)."""
        if self.cluster_reads is None:
            return self.tenancy.may_read(who, ns)
        return self.cluster_reads.fill(who, ns, keys, context.time_remaining())

    def hint(self, who: Identity, ns: bytes, entries: Callable[[], HintEntries]) -> list[bool]:
        """``entries`` validates the request's entries, after the read right is checked; all of
        them are charged, or none: a Hint the server refuses is not charged."""
        readable = self.tenancy.may_read(who, ns)
        checked = entries()  # every entry is checked before any is applied
        if not readable:  # an empty namespace has nothing to prefetch: every entry is answered reserved
            return [True] * len(checked)
        with self.quotas.hinting(who, checked):
            reserved = self.core.hint_entries(ns, checked)
        if self.cluster_reads is not None:  # pages held on other nodes are fetched ahead too, without waiting
            for (keys, _), ok in zip(checked, reserved):
                if ok:
                    self.cluster_reads.prefetch(who, ns, keys)
        return reserved

    def replicate(self, who: Identity, ns: bytes, keys: list[bytes], replicas: int, holder: str, tenant: str, page_bytes: int,
                  context: CallContext) -> int:
        """A client's ``put(replicas=n)``: other members copy the caller's pages held here
        (kvstore/server/cluster/replicas.py). With ``holder`` (the node right): this node is
        such a member, and fetches the pages from the holder for the tenant named."""
        if holder or tenant:
            require_node(who, "Replicate from a holder")
            return self._copy_from(acting_for(who, tenant), ns, keys, holder, page_bytes, context)
        if not who.allows(Rights.WRITE):
            raise PermissionDenied(f"tenant {who.tenant!r} lacks the write right (replicas are writes on other nodes)")
        if self.cluster is None:
            if replicas > 1:
                raise InvalidRequest("replicas > 1 needs cluster mode (--cluster)")
            held = self.core.directory.lookup(ns, keys) if self.tenancy.may_read(who, ns) else []
            return sum(r.num_pages for r in held)
        if not self.tenancy.may_read(who, ns):
            return 0  # as for an empty namespace
        return self.cluster.replicate(ns, keys, replicas, context.time_remaining(), on_behalf(who))

    def grant_transfer(self, who: Identity, node: str) -> tuple[bytes, int]:
        """A node's one-time grant for a connection to this node's UCX or TCP data port
        (kvstore/cluster/grants.py), and its ttl in ms; the node right first."""
        require_node(who, "GrantTransfer")
        if self.cluster is None or self.cluster.grants is None:
            raise InvalidRequest("GrantTransfer needs cluster mode with --data-plane ucx or tcp")
        if not 0 < len(node) <= MAX_NODE_ID:
            raise InvalidRequest(f"GrantTransfer names a node id of 1..{MAX_NODE_ID} characters, got {len(node)}")
        grants = self.cluster.grants
        return grants.issue(node), int(grants.ttl_s * 1000)

    def _copy_from(self, who: Identity, ns: bytes, keys: list[bytes], holder: str, page_bytes: int, context: CallContext) -> int:
        """The namespace is claimed for the tenant before the copy and bound only if it stored pages (Tenancy.copying)."""
        if self.cluster is None or page_bytes <= 0:
            raise InvalidRequest("Replicate with a holder needs cluster mode and page_bytes")
        remote = self.cluster.remote
        with self.tenancy.copying(who, ns, lambda: remote.local_prefix(ns, keys)):
            return self.cluster.copy_from(holder, ns, keys, page_bytes, context.time_remaining(), on_behalf(who),
                                          quota_landing(self.quotas, self.core, who, ns, keys))  # within its host quota

    def append_tokens(self, who: Identity, ns: bytes, sid: str, expected_length: int, tokens: list[int], prompt_tokens: int,
                      sync: bool) -> int:
        """A session fenced here (live migration) is refused, counted: FAILED_PRECONDITION naming its owner;
        only to its tenant (another is refused by Tenancy.writing, as for any write into the namespace)."""
        assert self.wal is not None, "the server builds the gate with its token log"
        fence = self.session_owners.writing(ns, sid, "AppendTokens") if self.tenancy.sees(who, ns) else nullcontext()
        with fence, self.tenancy.writing(who, ns), self.quotas.appending(who) as charge:
            return self.wal.append(ns, sid, expected_length, tokens, prompt_tokens, sync, charge)

    def read_session(self, who: Identity, ns: bytes, sid: str) -> tuple[int, list[int]] | None:
        """The session's prompt length and tokens; None as for one that does not exist."""
        assert self.wal is not None, "the server builds the gate with its token log"
        return self.wal.read(ns, sid) if self.tenancy.may_read(who, ns) else None

    def end_session(self, who: Identity, ns: bytes, sid: str) -> None:
        assert self.wal is not None, "the server builds the gate with its token log"
        if self.tenancy.may_administer(who, ns):  # else: as for a session that does not exist
            self.wal.end(ns, sid)
