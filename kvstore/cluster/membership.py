"""Cluster membership on etcd: who is alive, under which epoch, and namespace generations.

Layout in etcd (``<root>`` = ``/kvstore/<cluster>/``): ``nodes/<node-id>`` (JSON Member, under the node's lease),
``epochs/<node-id>`` (the node's last epoch, no lease); the generations, the incarnation and its age, fenced nodes
and caught-up marks: kvstore/cluster/README.md (### generation_records.py).

More: kvstore/cluster/README.md (### membership.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from kvstore.cluster.cluster_errors import CoordinatorUnavailable, NotAMember, WatchLost
from kvstore.cluster.epoch_file import EpochFile
from kvstore.cluster.etcd import EtcdClient, KeyValue, WatchEvent
from kvstore.cluster.members import Member, MembershipConfig, MemberState
from kvstore.errors import ConfigError, InvalidRequest

__all__ = ["Member", "MemberState", "Membership", "MembershipConfig"]

logger = logging.getLogger(__name__)


MembersListener = Callable[[Mapping[str, Member]], None]
StateListener = Callable[[MemberState, int], None]
KeyListener = Callable[[KeyValue], None]  # a key of a kind others follow (generations), as put
ReplacedListener = Callable[[], None]
RegisteringListener = Callable[[int], None]  # the epoch about to be put


class Membership:
    """This node's registration and its view of the cluster. Owns its background tasks
    (keep-alive and watch); ``close()`` leaves the cluster (revokes the lease) and ends them."""

    def __init__(self, client: EtcdClient, config: MembershipConfig, me: Member, epochs: EpochFile | None = None) -> None:
        if me.node_id != config.node_id:
            raise ConfigError(f"--node-id {config.node_id!r} does not match the member record ({me.node_id!r})")
        self.config = config
        self._etcd = client
        self._me = me
        self._state = MemberState.JOINING
        self._lease = 0
        self._lost_leases: set[int] = set()  # leases of this process a revoke has not ended yet (etcd was down)
        self._deadline = 0.0  # monotonic; a member only while now < deadline
        self._members: dict[str, Member] = {}
        self._ttl_warned: dict[str, int] = {}  # node -> the other TTL it was seen with (warned once)
        self._revision = 0    # last etcd revision folded into the view
        # when the last snapshot of the view was read (monotonic; 0: none yet): a node gone from etcd before it
        # was never in the view, so it never left it (server/cluster/cluster_generations.py)
        self.snapshot_at = 0.0
        self._changed = asyncio.Event()  # set and replaced on every change of view or state
        self._member_listeners: list[MembersListener] = []
        self._state_listeners: list[StateListener] = []
        self._key_listeners: dict[str, list[KeyListener]] = {}
        self._replaced_listeners: list[ReplacedListener] = []
        self._registering_listeners: list[RegisteringListener] = []
        self._epochs = epochs  # the last epoch, kept by the node (None: etcd's alone)
        if epochs is not None:
            self._me = replace(me, epoch=epochs.read())
        self._tasks: list[asyncio.Task[None]] = []
        self._keepalive = client.keepalive()

    # -- what the server reads -------------------------------------------------------------
    @property
    def state(self) -> MemberState:
        if self._state is MemberState.MEMBER and time.monotonic() >= self._deadline:
            return MemberState.LOST  # the keep-alive task may not have run yet (e.g. after SIGSTOP)
        return self._state

    @property
    def is_member(self) -> bool:
        return self.state is MemberState.MEMBER

    @property
    def epoch(self) -> int:
        return self._me.epoch

    @property
    def me(self) -> Member:
        return self._me

    @property
    def members(self) -> Mapping[str, Member]:
        """The live members as etcd lists them (this node included while it is registered)."""
        return dict(self._members)

    def check_member(self) -> int:
        """The current epoch; raises NotAMember while this node must not act as one."""
        if not self.is_member:
            raise NotAMember(f"node {self._me.node_id} is {self.state.value}, not a member")
        return self._me.epoch

    def on_members(self, listener: MembersListener) -> None:
        self._member_listeners.append(listener)

    def on_state(self, listener: StateListener) -> None:
        self._state_listeners.append(listener)

    def on_key(self, kind: str, listener: KeyListener) -> None:
        """``listener`` gets every key under ``<root><kind>/`` put (in each snapshot, then as
        the watch delivers them): values a node enters idempotently."""
        self._key_listeners.setdefault(kind, []).append(listener)

    def on_replaced(self, listener: ReplacedListener) -> None:
        """``listener`` is called when etcd's revision went back (wiped, or restored from an old
        snapshot): what this node wrote there may be gone, for it to write back."""
        self._replaced_listeners.append(listener)

    def on_registering(self, listener: RegisteringListener) -> None:
        """``listener`` is called with the new epoch just before each registration's transaction:
        what this node heard before it may be of a time the others did not list it."""
        self._registering_listeners.append(listener)

    async def put_under_lease(self, key: bytes, value: bytes) -> None:
        """Writes ``key`` under this node's lease (gone with it); CoordinatorUnavailable, or
        NotAMember while it holds none."""
        if not self._lease:
            raise NotAMember(f"node {self._me.node_id} holds no lease")
        await self._etcd.put(self.config.root + key, value, self._lease)

    async def revoke_lease(self, lease: int) -> None:
        """Revokes another node's lease (fencing it: it stops acting as a member within its TTL)."""
        if lease:
            await self._etcd.revoke(lease)

    @property
    def revision(self) -> int:
        """The last etcd revision folded into this node's view."""
        return self._revision

    async def registered(self) -> tuple[int, dict[str, KeyValue]]:
        """(etcd's revision, the node keys etcd holds now: node id -> its key, with its lease):
        read from etcd, not from this node's view, which may lag."""
        revision, kvs = await self._etcd.get_prefix(self.config.root + b"nodes/")
        return revision, {self._classify(kv.key)[1]: kv for kv in kvs}

    async def wait_for(self, predicate: Callable[[Membership], bool], timeout_s: float) -> None:
        """Returns once ``predicate(self)`` holds (checked on every change of view or state);
        raises TimeoutError after ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            while not predicate(self):
                await self._changed.wait()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, timeout_s: float = 30.0) -> None:
        """Loads the view, registers, and starts the keep-alive and watch tasks; returns once
        this node is a member (TimeoutError if that takes longer than ``timeout_s``)."""
        self._tasks = [asyncio.create_task(self._watch_loop(), name=f"membership-watch-{self._me.node_id}"),
                       asyncio.create_task(self._keepalive_loop(), name=f"membership-keepalive-{self._me.node_id}")]
        await self.wait_for(lambda m: m.is_member and m._me.node_id in m._members, timeout_s)

    async def close(self) -> None:
        """Leaves the cluster: revokes the lease (the others see this node go at once) and
        stops the tasks. Safe to call twice; a revoke that fails leaves expiry to etcd."""
        if self._state is MemberState.CLOSED:
            return
        self._set_state(MemberState.CLOSED)  # the loops stop at their next turn even if a cancel is lost
        for task in self._tasks:
            task.cancel()
        _, stuck = await asyncio.wait(self._tasks, timeout=2 * self._etcd.call_timeout_s + 1) if self._tasks else ((), ())
        for task in stuck:
            logger.error("membership task %s did not stop on close", task.get_name())
        self._keepalive.close()
        lease, self._lease = self._lease, 0  # after the loops: one of them may have just registered
        # the current lease first (its key tells the others this node left); one that fails ends the tries
        for each in [lease] * bool(lease) + sorted(self._lost_leases - {lease}):
            try:
                await self._etcd.revoke(each)
            except CoordinatorUnavailable as exc:
                logger.warning("node %s left without revoking lease %x (%s); etcd expires it", self._me.node_id, each, exc)
                break

    # -- registration and keep-alive ------------------------------------------------------------
    async def _register(self) -> None:
        """One attempt: a new lease, then epoch + 1 and the node key in one transaction."""
        root, node = self.config.root, self._me.node_id.encode()
        epoch_key, node_key = root + b"epochs/" + node, root + b"nodes/" + node
        for old in sorted(self._lost_leases):  # an etcd restarted on its data renews them for a TTL and more
            await self._etcd.revoke(old)
            self._lost_leases.discard(old)
        sent = time.monotonic()
        lease, ttl = await self._etcd.grant(self.config.ttl_s)
        try:
            previous = await self._etcd.get(epoch_key)
            # max with our own: an etcd restored from an old backup (or wiped) must not hand
            # out an epoch this node already used
            epoch = max(int(previous.value) if previous else 0, self._me.epoch) + 1
            me = replace(self._me, epoch=epoch)
            if self._epochs is not None:  # before etcd: an epoch handed out is never handed out again
                await asyncio.to_thread(self._epochs.write, epoch)
            for listener in self._registering_listeners:
                self._call(listener, epoch)
            won = await self._etcd.put_if([(epoch_key, str(epoch).encode(), 0), (node_key, me.to_json(), lease)],
                                          {epoch_key: previous.mod_revision if previous else 0, node_key: 0})
        except BaseException:
            await self._revoke_quietly(lease)
            raise
        if not won:
            await self._revoke_quietly(lease)
            holder = await self._etcd.get(node_key)
            held = f" (lease {holder.lease:x})" if holder else ""
            raise CoordinatorUnavailable(f"node id {self._me.node_id} is still registered{held}; waiting for it to expire")
        if self._state is MemberState.CLOSED:  # closed while registering: leave again at once
            await self._revoke_quietly(lease)
            return
        # what etcd grants may be longer (its minimum TTL): a node stops acting within its own
        # TTL regardless, which is what an issuer fencing it waits out (server/cluster/cluster_generations.py)
        self._me, self._lease, self._deadline = me, lease, sent + min(ttl, self.config.ttl_s)
        logger.info("node %s registered: epoch %d, lease %x, ttl %d s", me.node_id, epoch, lease, ttl)
        self._set_state(MemberState.MEMBER)

    async def _revoke_quietly(self, lease: int) -> None:
        try:
            await self._etcd.revoke(lease)
        except CoordinatorUnavailable as exc:  # revoked at the next registration (a lost reply may have put the key under it)
            logger.info("could not revoke lease %x (%s); revoked before registering again", lease, exc)
            self._lost_leases.add(lease)

    async def _keepalive_loop(self) -> None:
        cfg = self.config
        while self._state is not MemberState.CLOSED:
            try:
                if self.state is not MemberState.MEMBER:
                    if self._state is MemberState.MEMBER:
                        self._lose("no keep-alive acknowledged within the lease TTL")
                    if self._lease:  # revoked before registering again, however long etcd is down
                        self._lost_leases.add(self._lease)
                        self._lease = 0
                    await self._register()
                    continue
                sent = time.monotonic()
                ttl = await self._keepalive.ping(self._lease, timeout_s=min(self._etcd.call_timeout_s, cfg.keepalive_every_s))
                if ttl <= 0:
                    self._lose("etcd reports the lease gone")
                    continue
                self._deadline = max(self._deadline, sent + min(ttl, self.config.ttl_s))
                await asyncio.sleep(max(0.0, min(cfg.keepalive_every_s, self._deadline - time.monotonic())))
            except asyncio.CancelledError:
                raise
            except CoordinatorUnavailable as exc:
                logger.info("node %s: %s", self._me.node_id, exc)
                await asyncio.sleep(max(0.0, min(cfg.retry_s, self._deadline - time.monotonic())) if self._state is
                                    MemberState.MEMBER else cfg.retry_s)
            except Exception:
                logger.exception("membership keep-alive of node %s failed", self._me.node_id)
                await asyncio.sleep(cfg.retry_s)

    def _lose(self, why: str) -> None:
        logger.warning("node %s (epoch %d) stops acting as a member: %s", self._me.node_id, self._me.epoch, why)
        self._deadline = 0.0
        self._set_state(MemberState.LOST)

    def _set_state(self, state: MemberState) -> None:
        if state is self._state or self._state is MemberState.CLOSED:
            return
        self._state = state
        for listener in self._state_listeners:
            self._call(listener, state, self._me.epoch)
        self._notify()

    # -- the view ---------------------------------------------------------------------------
    async def _watch_loop(self) -> None:
        while self._state is not MemberState.CLOSED:
            try:
                revision, kvs = await self._etcd.get_prefix(self.config.root)
                self.snapshot_at = time.monotonic()
                self._apply_snapshot(revision, kvs)
                async for revision, events in self._etcd.watch_prefix(self.config.root, self._revision + 1):
                    self._apply_events(revision, events)
            except asyncio.CancelledError:
                raise
            except (CoordinatorUnavailable, WatchLost) as exc:
                logger.info("node %s: membership watch broke (%s); resyncing", self._me.node_id, exc)
                await asyncio.sleep(self.config.retry_s)
            except Exception:
                logger.exception("membership watch of node %s failed", self._me.node_id)
                await asyncio.sleep(self.config.retry_s)

    def _apply_snapshot(self, revision: int, kvs: list[KeyValue]) -> None:
        replaced = revision < self._revision
        if replaced:  # a replaced etcd (wiped, restored): its history is not ours
            logger.warning("etcd revision went back from %d to %d; re-reading everything", self._revision, revision)
        members: dict[str, Member] = {}
        for kv in kvs:
            kind, name = self._classify(kv.key)
            if kind == "nodes" and (member := self._parse_member(kv)) is not None:
                members[name] = member
            else:
                self._deliver(kind, kv)
        self._revision = revision
        self._set_members(members)
        if replaced:
            for listener in self._replaced_listeners:
                self._call(listener)

    def _apply_events(self, revision: int, events: list[WatchEvent]) -> None:
        members = dict(self._members)
        for ev in events:
            kind, name = self._classify(ev.kv.key)
            if kind == "nodes":
                if ev.kind == "delete":
                    members.pop(name, None)
                elif (member := self._parse_member(ev.kv)) is not None:
                    members[name] = member
            elif ev.kind == "put":
                self._deliver(kind, ev.kv)
        self._revision = revision
        self._set_members(members)

    def _classify(self, key: bytes) -> tuple[str, str]:
        kind, _, name = key[len(self.config.root):].decode(errors="replace").partition("/")
        return kind, name

    def _parse_member(self, kv: KeyValue) -> Member | None:
        try:
            return Member.from_json(kv.value)
        except InvalidRequest as exc:
            logger.warning("ignoring node record %r: %s", kv.key, exc)
            return None

    def _set_members(self, members: dict[str, Member]) -> None:
        if members == self._members:
            return
        self._members = members
        for node, m in members.items():
            if m.ttl_s and m.ttl_s != self.config.ttl_s and self._ttl_warned.get(node) != m.ttl_s:
                self._ttl_warned[node] = m.ttl_s
                logger.warning("node %s runs --cluster-ttl %d s, this node %d s: give every node the same TTL (after etcd "
                               "is replaced a node waits out its own TTL for nodes it never listed, DESIGN §12.4)",
                               node, m.ttl_s, self.config.ttl_s)
        for listener in self._member_listeners:
            self._call(listener, dict(members))
        self._notify()

    def _deliver(self, kind: str, kv: KeyValue) -> None:
        for listener in self._key_listeners.get(kind, ()):
            self._call(listener, kv)
        if kind in self._key_listeners:
            self._notify()  # wait_for predicates may read what a listener recorded

    @staticmethod
    def _call(listener: Callable[..., None], *args: object) -> None:
        try:
            listener(*args)
        except Exception:
            logger.exception("membership listener %r failed", listener)

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
