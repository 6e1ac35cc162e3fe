"""A session fenced here keeps its log from idle expiry until etcd says its target adopted that
fence's version (DESIGN §12.8). Found by a review of the first version of this: the "released"
mark was one per session, never cleared, so a session fenced, adopted, migrated back here and
fenced again was released already: its log, the only full copy until the new target adopts,
idled out, and a migration resumed later than the idle time could never finish. The mark is per
version now (etcd's reads faked; end to end: tests/cluster/test_migration.py). And a mark lost with a
wiped etcd is written again at the owner's catch-up (a real etcd)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from support.clock import Clock
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture

from kvstore.cluster.etcd import EtcdClient
from kvstore.cluster.session_records import SessionRecord
from kvstore.server.cluster.migrations import SessionMoves
from kvstore.server.session_owners import FENCED, FREEZING, INCOMING, OWNED, Ownership, SessionOwners
from kvstore.server.tokenlog import TokenLog

NSID = b"\x01" * 16


def test_a_session_fenced_again_after_a_round_trip_is_kept_until_adopted_again(tmp_path) -> None:
    clock = Clock(1000.0)
    wal = TokenLog(tmp_path, clock=clock, monotonic=clock)
    try:
        owners = SessionOwners(wal, "a", lambda call: None)
        etcd: dict[str, SessionRecord] = {}
        moves = SessionMoves(SimpleNamespace(node="a", serving=True), owners, wal)  # type: ignore[arg-type]
        moves.read = lambda ns, sid: etcd.get(sid)  # type: ignore[method-assign]

        def sweep() -> int:  # SessionExpiry.sweep: refresh, then expire
            moves.release_adopted()
            return wal.expire_idle(100.0, owners.kept)

        # trip 1: a -> b, adopted at b; a's log is released and idles out (as designed)
        wal.append(NSID, "s", 0, [1, 2, 3], prompt_tokens=1)
        owners.put(NSID, "s", Ownership(0, FREEZING, "b"))
        owners.put(NSID, "s", Ownership(1, FENCED, "b"))
        etcd["s"] = SessionRecord(1, "b", adopted=True)
        clock.now += 200
        assert sweep() == 1 and wal.read(NSID, "s") is None
        # trip 2: b -> a (Copy at a: INCOMING and the log; Adopt: OWNED v2)
        owners.put(NSID, "s", Ownership(1, INCOMING, "b"))
        wal.append(NSID, "s", 0, [1, 2, 3, 4], prompt_tokens=1)
        etcd["s"] = SessionRecord(2, "a")
        owners.put(NSID, "s", Ownership(2, OWNED, "a"))
        etcd["s"] = SessionRecord(2, "a", adopted=True)
        # trip 3: a -> b fenced at v3; the driver dies before b's Adopt: a's log is the only full copy
        owners.put(NSID, "s", Ownership(2, FREEZING, "b"))
        etcd["s"] = SessionRecord(3, "b")
        owners.put(NSID, "s", Ownership(3, FENCED, "b"))
        clock.now += 200
        sweep()
        assert wal.read(NSID, "s") == (1, [1, 2, 3, 4]), "the fenced log v3 needs was ended before b adopted v3"
    finally:
        wal.close()


async def test_an_adoption_etcd_lost_is_marked_again_at_the_owners_catch_up(etcd, tmp_path) -> None:
    """The seam of a fenced log and a replaced etcd: the target's mark ("adopted") is lost with a
    wiped etcd; the catch-up (``reconcile``, real etcd) writes the owner's record back marked, and
    marks one written back unmarked by the source (either node may reach etcd first)."""
    client = EtcdClient([etcd.endpoint], call_timeout_s=1.0)
    loop = asyncio.get_running_loop()
    wal = TokenLog(tmp_path)
    try:
        owners = SessionOwners(wal, "b", lambda call: None)
        cluster = SimpleNamespace(node="b", etcd=client, cluster=SimpleNamespace(rpc_timeout_s=1.0),
                                  membership=SimpleNamespace(config=SimpleNamespace(root=b"/fenced-logs/")),
                                  call=lambda coro, timeout: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout))
        moves = SessionMoves(cluster, owners, wal)  # type: ignore[arg-type]
        owners.put(NSID, "s", Ownership(1, OWNED, "b"))  # adopted here; etcd lost everything
        await asyncio.to_thread(moves.reconcile)
        assert await moves.etcd.read(NSID, "s") == SessionRecord(1, "b", adopted=True)
        owners.put(NSID, "t", Ownership(1, OWNED, "b"))  # the source wrote it back first, unmarked
        assert await moves.etcd.decide(NSID, "t", 1, "b") == SessionRecord(1, "b")
        await asyncio.to_thread(moves.reconcile)
        assert await moves.etcd.read(NSID, "t") == SessionRecord(1, "b", adopted=True)
    finally:
        wal.close()
        await client.close()
