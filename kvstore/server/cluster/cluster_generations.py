"""Namespace generations across the cluster (DESIGN §12.4).

More: kvstore/server/cluster/README.md (### cluster_generations.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from kvstore._proto import directory_pb2
from kvstore.cluster.cluster_errors import CoordinatorUnavailable, NotAMember
from kvstore.cluster.epoch_file import EpochFile
from kvstore.cluster.etcd import KeyValue
from kvstore.cluster.generation_records import EtcdGenerations
from kvstore.cluster.membership import Member, Membership
from kvstore.errors import InvalidRequest, TierUnavailable
from kvstore.server.cluster.peers import Peers, current_cancelled
from kvstore.server.placement import Placement

logger = logging.getLogger(__name__)

VIEW_WAIT_S = 1.0  # how long an invalidation waits for this node's view to list a node etcd lists
FENCE_MARGIN_S = 0.5  # past a fenced node's TTL, for clocks that do not tick alike
SEED_AT_ONCE = 64  # generations written back to etcd concurrently
# generations entered in one worker-thread call, one synced LMDB transaction (DESIGN §12.5): the loop (keep-alives) runs
# between them, and a lookup waits for the directory's lock at most one of them
ENTER_AT_ONCE = 1024
MAX_RETRY_S = 5.0  # the longest wait between catch-ups that failed in an unforeseen way
REGISTER_AGAIN_S = 1.0  # past a keep-alive period, for a node of a replaced etcd to find its lease gone and register


class GenerationSync:
    def __init__(self, core: Placement, etcd: EtcdGenerations, membership: Membership, peers: Peers, node: str,
                 ttl_s: float, rpc_timeout_s: float, before_serving: Callable[[], object] | None = None,
                 epochs: EpochFile | None = None) -> None:
        self._core = core
        self._etcd = etcd
        self._membership = membership
        self._peers = peers
        self._node = node
        self._ttl_s = ttl_s
        self._rpc_timeout_s = rpc_timeout_s
        self._before_serving = before_serving  # at every catch-up, in a worker thread
        self._caught_up = 0  # the registration epoch whose catch-up finished (0: none yet)
        self._epochs = epochs  # where the incarnation caught up with last is kept, across restarts
        # etcd's incarnation id when this node last looked (across restarts: the file's)
        self._incarnation = epochs.read_incarnation() if epochs is not None else b""
        self._incarnation_age = 0.0  # ... and how long ago, at least, it was made (by etcd's clock)
        self._replaced = False  # this node met another etcd than the one it knew: the young wait applies
        self.num_fenced = 0
        # until then a node that left this node's view may still serve (``left``, ``etcd_replaced``, ``_fence``);
        # one it never listed: ``_unlisted``
        self._quiet_until = 0.0
        self._heard: dict[bytes, int] = {}  # delivered by etcd, not entered yet (``heard``)
        self._entering: asyncio.Task[None] | None = None  # the task entering them

    @property
    def serving(self) -> bool:
        """A member now, caught up with etcd's generations since it registered."""
        membership = self._membership
        return membership.is_member and self._caught_up == membership.epoch

    async def enter(self, namespace_id: bytes, generation: int) -> None:
        await self.enter_all({namespace_id: generation})

    async def enter_all(self, raised: Mapping[bytes, int]) -> None:
        """Enters every generation of ``raised`` (idempotent, never backwards) in worker threads, ``ENTER_AT_ONCE``
        per call: one synced LMDB transaction each, the loop free between them."""
        items = list(raised.items())
        for start in range(0, len(items), ENTER_AT_ONCE):
            chunk = dict(items[start : start + ENTER_AT_ONCE])
            removed = await asyncio.to_thread(self._core.enter_generations, chunk)
            for namespace_id, count in removed.items():
                if count or len(removed) == 1:
                    logger.info("namespace %s entered generation %d: %d pages dropped here", namespace_id.hex(),
                                chunk[namespace_id], count)
            if len(removed) > 1:
                logger.info("%d namespaces entered their generations from etcd (%d pages dropped here)", len(removed),
                            sum(removed.values()))

    def _fence_wait(self, member: Member | None = None) -> float:
        """How long a node may serve after its last acknowledged keep-alive (its TTL, or ours)."""
        ttl = max(self._ttl_s, member.ttl_s if member is not None else 0)
        return ttl * 1.05 + FENCE_MARGIN_S

    def _quiet_for(self, wait: float) -> None:
        self._quiet_until = max(self._quiet_until, time.monotonic() + wait)

    def etcd_replaced(self) -> None:
        """etcd went back: the nodes registered in the old one serve until their keep-alives
        find their leases gone (within a TTL); they are not listed in the new one meanwhile."""
        self._quiet_for(max([self._fence_wait(m) for m in self._membership.members.values()], default=self._fence_wait()))

    def _unlisted(self) -> None:
        """Nodes gone from etcd before this node's view was last read from it (at its start, after a
        watch broke) never left that view. One whose lease expired stopped serving by then, by its own
        clock: the margin covers clocks that do not tick alike. Fenced ones are waited for by their
        records (``_fence``), those of a replaced etcd by the incarnation's age (``_check_incarnation``)."""
        snapshot_at = self._membership.snapshot_at
        self._quiet_for(self._fence_wait() - self._ttl_s - (time.monotonic() - snapshot_at) if snapshot_at
                        else self._fence_wait())

    def left(self, members: list[Member]) -> None:
        """Nodes left this node's view (expired, left, fenced by another issuer): until their
        TTL is out they may still serve, unlisted."""
        for member in members:
            self._quiet_for(self._fence_wait(member))

    async def _check_incarnation(self) -> None:
        """etcd replaced since this node last looked (another incarnation id): ``etcd_replaced``.
        A node of an etcd replaced before this one was made or last started (a restored backup) may
        serve up to a TTL past that (one this node never listed, whatever it knew: assumed of a TTL
        no longer than its own)."""
        incarnation, self._incarnation_age = await self._etcd.incarnation()
        self._quiet_for(self._fence_wait() - self._incarnation_age)
        if self._incarnation and incarnation != self._incarnation:
            logger.warning("etcd was replaced (its incarnation id changed): what it lost is written back")
            self.etcd_replaced()
            self._replaced = True
        if incarnation != self._incarnation and self._epochs is not None:
            await asyncio.to_thread(self._epochs.write_incarnation, incarnation)
        self._incarnation = incarnation

    def heard(self, kv: KeyValue) -> asyncio.Task[None] | None:
        """A generation the watch or a snapshot delivered (on the loop): entered in worker threads together with
        every other one delivered before the loop runs again (a snapshot delivers a record of every namespace
        ever invalidated at once), and with those delivered while they are entered. Returns the task that
        enters them when this call started it."""
        parsed = self._etcd.parse(kv)
        if parsed is None:
            return None
        namespace_id, generation = parsed
        self._heard[namespace_id] = max(generation, self._heard.get(namespace_id, 0))
        if self._entering is not None and not self._entering.done():
            return None
        self._entering = asyncio.ensure_future(self._enter_heard())
        return self._entering

    async def _enter_heard(self) -> None:
        while self._heard:
            heard, self._heard = self._heard, {}
            try:
                await self.enter_all(heard)
            except Exception:  # as an enter's failure always was: logged, the next catch-up enters them
                logger.exception("entering %d generations etcd delivered failed", len(heard))

    # -- catching up ---------------------------------------------------------------------------
    async def catch_up(self, epoch: int) -> bool:
        """Enters every generation etcd holds, writes back what etcd lacks, then serves (if
        this node is still registered under ``epoch``). False when etcd did not answer."""
        try:
            await self._check_incarnation()
            _, held = await self._etcd.read_all()
            current = self._core.directory.generation
            await self.enter_all({ns: g for ns, g in held.items() if g > current(ns)})
            lacking = [(ns, g) for ns, g in self._core.directory.generations().items() if held.get(ns, 0) < g]
            for start in range(0, len(lacking), SEED_AT_ONCE):  # after a wipe, every namespace ever invalidated
                batch = lacking[start : start + SEED_AT_ONCE]
                seeded = await asyncio.gather(*(self._etcd.seed(ns, g) for ns, g in batch))
                if any(seeded):
                    logger.warning("etcd lacked the generations of %d namespaces (replaced or restored?): written back",
                                   sum(seeded))
            if self._before_serving is not None:
                await asyncio.to_thread(self._before_serving)
            await self._membership.put_under_lease(self._etcd.caught_up_prefix[len(self._membership.config.root):] +
                                                   self._node.encode(), self._incarnation)
            await self._wait_for_the_others()
            _, held = await self._etcd.read_all()  # what they wrote back
            await self.enter_all({ns: g for ns, g in held.items() if g > current(ns)})
        except (CoordinatorUnavailable, NotAMember) as exc:
            logger.info("catching up with etcd's generations failed (%s); retrying", exc)
            return False
        if self._membership.epoch == epoch:
            self._caught_up = epoch
            logger.info("node %s caught up with etcd's generations (epoch %d): serving", self._node, epoch)
        return True

    async def _wait_for_the_others(self) -> None:
        """Until every other node etcd lists caught up in this etcd (up to a fence wait: one that
        does not is stuck, or gone within its TTL)."""
        # a new etcd: a live node of the old one finds its lease gone at its next keep-alive (every TTL/3) and
        # registers again at once
        young = self._ttl_s / 3 + REGISTER_AGAIN_S - self._incarnation_age
        if young > 0 and self._replaced:
            await asyncio.sleep(young)
        give_up = time.monotonic() + self._fence_wait()
        while True:
            _, registered = await self._membership.registered()
            marks = await self._etcd.caught_up()
            behind = sorted(n for n in registered if n != self._node and marks.get(n) != self._incarnation)
            if not behind:
                return
            if time.monotonic() > give_up:
                logger.warning("nodes %s did not catch up with etcd within a TTL; serving without them", ", ".join(behind))
                return
            await asyncio.sleep(0.1)

    async def keep_catching_up(self, epoch: int, retry_s: float) -> None:
        """``catch_up`` until it succeeds or the node registered again (that one catches up itself). An
        unforeseen error (a salts file that cannot be written) is logged and retried, less often each time:
        a catch-up given up would leave the node registered and serving nothing until it registered again."""
        failed = 0  # unforeseen failures in a row
        while self._membership.epoch == epoch:
            try:
                if await self.catch_up(epoch):
                    return
                failed = 0
            except Exception:
                failed += 1
                logger.exception("catching up with etcd failed (node %s serves no reads until it does); retrying in %.2f s",
                                 self._node, min(retry_s * 2**failed, MAX_RETRY_S))
            await asyncio.sleep(min(retry_s * 2**failed, MAX_RETRY_S))

    # -- invalidating ------------------------------------------------------------------------
    async def invalidate(self, namespace_id: bytes, timeout_s: float) -> tuple[int, int]:
        """Raises the namespace's generation cluster-wide; returns (pages removed here, the
        new generation) once every node etcd lists has entered it or was fenced. Raises
        TierUnavailable when etcd did not take it (nothing changed) or when the deadline came
        before a fenced node's TTL ran out (the generation stands; that node serves nothing
        once its TTL is over)."""
        deadline = time.monotonic() + timeout_s
        try:
            await self._check_incarnation()
            generation = await self._etcd.raise_above(namespace_id, self._core.directory.generation(namespace_id))
        except CoordinatorUnavailable as exc:
            raise TierUnavailable(f"etcd did not take the invalidation of namespace {namespace_id.hex()} ({exc}); "
                                  "nothing was invalidated: try again") from None
        try:
            revision, registered = await self._membership.registered()
            for serves_s in await self._etcd.fenced():  # nodes fenced before this node's view listed them, say
                self._quiet_for(serves_s)
        except CoordinatorUnavailable as exc:
            raise TierUnavailable(f"namespace {namespace_id.hex()} is at generation {generation} in etcd, but etcd did "
                                  f"not say which nodes to tell ({exc}): not confirmed, try again") from None
        if revision < self._membership.revision:  # etcd went back before this node's watch said so
            self.etcd_replaced()
        self._unlisted()
        viewed = self._membership.members
        for node in set(viewed) - set(registered) - {self._node}:  # gone from etcd, not yet from the view
            self._quiet_for(self._fence_wait(viewed[node]))
        removed = await asyncio.to_thread(self._core.enter_generation, namespace_id, generation) or 0
        others = {node: kv for node, kv in registered.items() if node != self._node}
        unconfirmed = await self._push(namespace_id, generation, others, deadline)
        if unconfirmed:
            await self._fence(namespace_id, generation, unconfirmed, deadline)
        await self._quiet(namespace_id, generation, sorted(unconfirmed), deadline)
        return removed, generation

    async def _push(self, namespace_id: bytes, generation: int, nodes: dict[str, KeyValue],
                    deadline: float) -> dict[str, KeyValue]:
        """Tells every node of ``nodes``; returns those that did not confirm."""
        try:  # peers come from this node's view, which may lag etcd by a watch event
            await self._membership.wait_for(lambda m: set(nodes) <= set(m.members), min(VIEW_WAIT_S, deadline - time.monotonic()))
        except TimeoutError:
            pass
        told = await asyncio.gather(*(self._tell(node, namespace_id, generation, deadline) for node in nodes))
        return {node: kv for (node, kv), ok in zip(nodes.items(), told) if not ok}

    async def _tell(self, node: str, namespace_id: bytes, generation: int, deadline: float) -> bool:
        peer = self._peers.get(node)
        timeout = min(self._rpc_timeout_s, deadline - time.monotonic())
        if peer is None or timeout <= 0:
            return False
        request = directory_pb2.InvalidateRequest(namespace_id=namespace_id, generation=generation)
        try:
            answer = await peer.directory.Invalidate(request, timeout=timeout)
        except asyncio.CancelledError:
            if current_cancelled():
                raise
            logger.warning("node %s left while told generation %d of namespace %s (its channel closed)", node,
                           generation, namespace_id.hex())
            return False
        except Exception as exc:  # noqa: BLE001 - whatever failed, the node did not confirm: it is fenced
            logger.warning("node %s did not confirm generation %d of namespace %s: %r", node, generation,
                           namespace_id.hex(), exc)
            return False
        return int(answer.generation) >= generation

    async def _fence(self, namespace_id: bytes, generation: int, nodes: dict[str, KeyValue], deadline: float) -> None:
        """Revokes the leases of nodes that did not confirm: a node counts itself a member (and
        serves) only within TTL of its last acknowledged refresh, which the caller waits out. A
        revoke etcd does not take is tried again until the deadline: a node whose lease lives
        on (its keep-alives still reach etcd) would serve on. TierUnavailable when one never was.
        Each revoke is recorded in etcd for as long as its node may serve: an issuer whose view
        never listed that node waits for it too."""
        viewed = self._membership.members
        for node, kv in nodes.items():
            serves_s = self._serves_s(viewed.get(node), kv)
            while True:
                try:  # the record first: a node revoked is never unrecorded
                    noted = await self._etcd.note_fenced(node, kv.lease, serves_s)
                    await self._membership.revoke_lease(kv.lease)
                    break
                except CoordinatorUnavailable as exc:
                    if time.monotonic() + 0.2 > deadline:
                        raise TierUnavailable(f"namespace {namespace_id.hex()} is at generation {generation} in etcd, "
                                              f"but node {node} did not confirm it and etcd did not take the revoke of "
                                              f"its lease ({exc}): it may still serve the older one") from None
                    await asyncio.sleep(0.2)
            self.num_fenced += 1
            self._quiet_for(serves_s)
            try:  # the record's margin for a revoke yet to land is no longer needed
                await self._etcd.fence_settled(node, kv.lease, serves_s, noted)
            except CoordinatorUnavailable as exc:
                logger.info("the record of node %s's fencing keeps its margin (%s)", node, exc)
        logger.warning("nodes %s did not confirm generation %d of namespace %s: fenced (leases revoked)",
                       ", ".join(sorted(nodes)), generation, namespace_id.hex())

    def _serves_s(self, viewed: Member | None, kv: KeyValue) -> float:
        """How long a node may serve past a revoke of its lease: by its TTL as etcd holds it, or as
        this node's view does (which may lag etcd, or lack the node), whichever is longer."""
        try:
            registered: Member | None = Member.from_json(kv.value)
        except InvalidRequest:
            registered = None
        return max(self._fence_wait(viewed), self._fence_wait(registered))

    async def _quiet(self, namespace_id: bytes, generation: int, fenced: list[str], deadline: float) -> None:
        """Waits until no node that did not confirm can still be serving (``_quiet_until``)."""
        wait = self._quiet_until - time.monotonic()
        if wait <= 0:
            return
        if time.monotonic() + wait > deadline:
            who = f"nodes {', '.join(fenced)} did not confirm (their leases were revoked)" if fenced else \
                "a node this one does not list may not know it yet (one that left or another node fenced, or one " \
                "an etcd made or restarted within a TTL may have lost)"
            raise TierUnavailable(f"namespace {namespace_id.hex()} is at generation {generation} in etcd and at every node "
                                  f"that answered, but {who}: no node serves an older generation after {wait:.1f} s; "
                                  "give the call a deadline past that to have it confirmed")
        await asyncio.sleep(wait)
