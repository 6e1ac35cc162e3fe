"""Sessions end when idle (--session-idle-s): an engine cannot tell when a conversation is over,
and a log never ended held its tenant's token-log quota for ever (the vLLM connector never ends
the sessions it logs). A session is ended only once nothing was appended to it for the idle
time, counted from its last append, across restarts; an append meanwhile keeps it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import lmdb
import pytest
from support.certs import CertAuthority
from support.clock import Clock
from support.servers import make_config
from support.tenants import A, Caller, new_ns, tenant_config, tenant_grants

from kvstore._proto import data_pb2
from kvstore.client import KVStoreClient
from kvstore.errors import ConfigError, InvalidRequest, TierUnavailable
from kvstore.server import Server
from kvstore.server.session_expiry import MIN_PERIOD_S
from kvstore.server.session_owners import FREEZING, INCOMING, OWNED, Ownership
from kvstore.server.tokenlog import TokenLog

NS = b"\x01" * 16


def test_a_session_ends_once_idle_for_the_idle_time_from_its_last_append(tmp_path) -> None:
    clock = Clock(1000.0)
    wal = TokenLog(tmp_path, clock=clock, monotonic=clock)
    try:
        assert wal.append(NS, "quiet", 0, [1, 2, 3], prompt_tokens=2) == 3
        assert wal.append(NS, "busy", 0, [7]) == 1
        clock.now = 1090.0
        assert wal.append(NS, "busy", 1, [8]) == 2
        clock.now = 1099.0
        assert wal.expire_idle(100.0) == 0, "nothing idle for 100 s yet"
        clock.now = 1101.0
        assert wal.expire_idle(100.0) == 1
        assert wal.read(NS, "quiet") is None and wal.read(NS, "busy") == (0, [7, 8])
        assert wal.tokens_of(NS) == 2, "the ended session's tokens no longer count to the quota"
        clock.now = 1191.0
        assert wal.expire_idle(100.0) == 1 and wal.tokens_of(NS) == 0
    finally:
        wal.close()


def test_a_session_that_cannot_end_now_holds_up_no_other(tmp_path, caplog) -> None:
    """One session whose end fails (here its keep check raises; a full LMDB map does the same)
    no longer stops the round: the others end, their tokens stop counting, and it is tried
    again at the next sweep."""
    clock = Clock(1000.0)
    wal = TokenLog(tmp_path, clock=clock, monotonic=clock)
    try:
        for name in ("a", "b", "c"):
            assert wal.append(NS, name, 0, [1, 2]) == 2
        clock.now = 1200.0
        stuck = {NS + b"a\0"}  # a session's key: namespace, id, NUL

        def keep(sid: bytes) -> bool:
            if sid in stuck:
                raise RuntimeError("cannot decide now")
            return False

        assert wal.expire_idle(100.0, keep) == 2
        assert wal.read(NS, "b") is None and wal.read(NS, "c") is None and wal.read(NS, "a") == (0, [1, 2])
        assert wal.tokens_of(NS) == 2
        assert "could not be ended now" in caplog.text
        stuck.clear()
        assert wal.expire_idle(100.0, keep) == 1 and wal.tokens_of(NS) == 0
    finally:
        wal.close()


def test_the_last_append_time_survives_a_restart(tmp_path) -> None:
    clock = Clock(1000.0)
    wal = TokenLog(tmp_path, clock=clock, monotonic=clock)
    wal.append(NS, "s", 0, [1, 2])
    wal.close()
    clock.now = 1050.0
    wal = TokenLog(tmp_path, clock=clock, monotonic=clock)  # reopened: idle since 1000, not since the reopen
    try:
        assert wal.expire_idle(100.0) == 0
        clock.now = 1101.0
        assert wal.expire_idle(100.0) == 1 and wal.read(NS, "s") is None
    finally:
        wal.close()


def test_a_log_of_the_older_format_reads_and_idles_from_its_opening(tmp_path) -> None:
    """A meta record without a time (written before sessions idled out) is read as before and
    counts as appended when the log was opened: nothing is ended at once by an upgrade."""
    TokenLog(tmp_path).close()
    env = lmdb.open(str(tmp_path / "wal.lmdb"), max_dbs=3)
    meta, chunks = env.open_db(b"meta"), env.open_db(b"chunks")
    sid = NS + b"old\0"
    with env.begin(write=True) as txn:
        txn.put(sid, (1).to_bytes(4, "little") + (3).to_bytes(8, "little"), db=meta)
        txn.put(sid + (0).to_bytes(8, "big"), b"".join(t.to_bytes(4, "little") for t in (5, 6, 7)), db=chunks)
    env.close()
    clock = Clock(5000.0)
    wal = TokenLog(tmp_path, clock=clock, monotonic=clock)
    try:
        assert wal.read(NS, "old") == (1, [5, 6, 7]) and wal.tokens_of(NS) == 3
        clock.now = 5099.0
        assert wal.expire_idle(100.0) == 0
        assert wal.append(NS, "old", 3, [8]) == 4, "an append rewrites it in the new format"
        clock.now = 5198.0
        assert wal.expire_idle(100.0) == 0
        clock.now = 5200.0
        assert wal.expire_idle(100.0) == 1 and wal.tokens_of(NS) == 0
    finally:
        wal.close()


def test_a_wall_clock_set_forward_ends_no_session(tmp_path) -> None:
    """Bug: the idle time was read from the wall clock only, so a clock stepped forward (NTP
    correcting a clock that ran behind) by more than the idle time ended every session at the
    next sweep, also one appended to a moment before: its acknowledged tokens were gone. Within
    a run the idle time is measured on the monotonic clock; the wall clock only carries it
    across a restart."""
    wall = Clock(1000.0)
    wal = TokenLog(tmp_path, clock=wall)
    try:
        assert wal.append(NS, "live", 0, [1, 2, 3]) == 3
        wall.now += 3 * 86_400.0  # the clock is stepped three days ahead; no time passed
        assert wal.expire_idle(100.0) == 0
        assert wal.read(NS, "live") == (0, [1, 2, 3]) and wal.tokens_of(NS) == 3
    finally:
        wal.close()


def test_a_wall_clock_set_back_across_a_restart_still_idles_a_session_out(tmp_path) -> None:
    """Bug: a log reopened after the wall clock was set back (it had run ahead) held last-append
    times in the future, and its sessions lived until the clock caught up with them (a clock a
    year ahead: a year), holding their tenant's quota. A time ahead of the clock at the opening
    counts as appended when the log was opened."""
    wall, mono = Clock(1000.0), Clock(50.0)
    wal = TokenLog(tmp_path, clock=wall, monotonic=mono)
    wal.append(NS, "s", 0, [1, 2])
    wal.close()
    wall.now -= 365 * 86_400.0  # set back a year before the restart
    wal = TokenLog(tmp_path, clock=wall, monotonic=mono)
    try:
        mono.now += 99.0
        assert wal.expire_idle(100.0) == 0
        mono.now += 2.0
        assert wal.expire_idle(100.0) == 1 and wal.read(NS, "s") is None and wal.tokens_of(NS) == 0
    finally:
        wal.close()


def test_a_record_of_the_older_format_idles_from_the_first_opening_not_every_restart(tmp_path) -> None:
    """Bug: a record of the older format counted as appended when the log was opened, every time
    it was opened, so a server restarted more often than its idle time never ended such a session.
    The first opening writes its time into the record."""
    TokenLog(tmp_path).close()
    env = lmdb.open(str(tmp_path / "wal.lmdb"), max_dbs=3)
    meta, chunks = env.open_db(b"meta"), env.open_db(b"chunks")
    with env.begin(write=True) as txn:
        txn.put(NS + b"old\0", (0).to_bytes(4, "little") + (1).to_bytes(8, "little"), db=meta)
        txn.put(NS + b"old\0" + (0).to_bytes(8, "big"), (5).to_bytes(4, "little"), db=chunks)
    env.close()
    clock = Clock(5000.0)
    TokenLog(tmp_path, clock=clock, monotonic=clock).close()  # upgraded at 5000
    clock.now = 5080.0
    wal = TokenLog(tmp_path, clock=clock, monotonic=clock)  # restarted
    try:
        assert wal.read(NS, "old") == (0, [5])
        clock.now = 5101.0
        assert wal.expire_idle(100.0) == 1 and wal.tokens_of(NS) == 0
    finally:
        wal.close()


def test_a_bad_idle_time_is_a_config_error(tmp_path) -> None:
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--session-idle-s"):
            make_config(tmp_path, session_idle_s=bad)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertAuthority:
    return CertAuthority(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def idle_server(tmp_path, ca) -> Iterator[Server]:
    config = tenant_config(tmp_path, ca, session_idle_s=1.0)
    assert config.security.auth_file is not None
    config.security.auth_file.write_text(json.dumps({"tokens": tenant_grants(), "quotas": {"a": {"token_log_bytes": 400}}}))
    server = Server(config)
    server.start()
    yield server
    server.stop(grace_s=1)


def test_an_idle_session_gives_its_tenant_quota_back_on_a_real_server(idle_server, ca) -> None:
    """Tenant a's quota holds 100 tokens: its first session fills most of it and a second is
    refused; once the first idled out (the log's clock moved past the idle time; the sweeper
    runs on its own), the second is taken. Counted in /metrics."""
    a = Caller(idle_server, ca, A)
    ns = new_ns()
    clock = Clock(time.monotonic())
    idle_server.wal.monotonic = clock  # the idle time passes when the test says, whatever the load

    def append(session: str, n: int) -> grpc.StatusCode:
        return a.code(a.data.AppendTokens, data_pb2.AppendTokensRequest(namespace_id=ns, session_id=session,
                                                                          tokens=list(range(n))))

    assert append("first", 60) == grpc.StatusCode.OK
    assert append("second", 45) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert a(a.data.GetSession, data_pb2.GetSessionRequest(namespace_id=ns, session_id="first")).found
    clock.now += 1.5
    deadline = time.monotonic() + 30
    while append("second", 45) != grpc.StatusCode.OK:
        assert time.monotonic() < deadline, "the idle session was not ended within 30 s (sweeps every 0.25 s)"
        time.sleep(0.05)
    assert not a(a.data.GetSession, data_pb2.GetSessionRequest(namespace_id=ns, session_id="first")).found
    assert a(a.data.GetSession, data_pb2.GetSessionRequest(namespace_id=ns, session_id="second")).found
    assert idle_server.metrics.registry.get_sample_value("kvstore_sessions_expired_total") == 1


async def test_a_session_whose_migration_is_undecided_is_not_idled_out(server_factory, ns) -> None:
    """Bug: a session being fenced (FREEZING: etcd has not decided, e.g. unreachable) or copied
    in (INCOMING) refuses its writer's appends ("retry"), so nothing could be appended to it, and
    the sweeper ended it once its last append was older than the idle time: the abort that
    gave it back (OWNED) found its log gone and the writer's next append a gap (its acknowledged
    tokens lost). Undecided sessions are kept, and an ownership change restarts the idle time."""
    server = server_factory(session_idle_s=100.0)  # the sweeper's own round is 25 s away: the test sweeps
    clock = Clock(time.monotonic())
    server.wal.monotonic = clock
    async with KVStoreClient(server.address, ns) as client:
        nsid = client.namespace.namespace_id
        for sid in ("freezing", "incoming"):
            assert await client.append_tokens(sid, [1, 2, 3], expected_length=0, sync=True) == 3
        server.session_owners.put(nsid, "freezing", Ownership(0, FREEZING, "n2"))  # a fence etcd has not decided
        server.session_owners.put(nsid, "incoming", Ownership(0, INCOMING, "n2"))  # a copy not adopted yet
        with pytest.raises(TierUnavailable, match="retry"):
            await client.append_tokens("freezing", [4], expected_length=3, sync=True)
        clock.now += 1000.0
        server.session_expiry.sweep()
        assert (await client.read_session("freezing")).tokens == [1, 2, 3]  # type: ignore[union-attr]
        assert (await client.read_session("incoming")).tokens == [1, 2, 3]  # type: ignore[union-attr]
        server.session_owners.put(nsid, "freezing", Ownership(1, OWNED, server.config.node))  # the abort gives it back
        server.session_expiry.sweep()
        assert await client.append_tokens("freezing", [4], expected_length=3, sync=True) == 4, "the writer goes on"
        clock.now += 101.0
        assert server.session_expiry.sweep() == 1, "owned again, it idles out as any session"
        assert await client.read_session("freezing") is None


async def test_an_append_to_a_session_that_idled_out_says_so(server_factory, ns) -> None:
    """A writer whose session idled out under it (the vLLM connector, client/session.py) appends
    at the length it knows: the answer is INVALID_ARGUMENT saying the session has no log here and
    why it may have gone, not only a length mismatch ("has 0 tokens logged"), and logs nothing."""
    server = server_factory(session_idle_s=100.0)
    clock = Clock(time.monotonic())
    server.wal.monotonic = clock
    async with KVStoreClient(server.address, ns) as client:
        assert await client.append_tokens("s", [1, 2, 3], expected_length=0, sync=True) == 3
        clock.now += 101.0
        assert server.session_expiry.sweep() == 1
        with pytest.raises(InvalidRequest, match="idle past --session-idle-s"):
            await client.append_tokens("s", [4], expected_length=3, sync=True)
        assert await client.read_session("s") is None


def test_a_tiny_idle_time_does_not_spin_the_sweeper(server_factory) -> None:
    """Bug: the sweeper ran every quarter of the idle time with no floor: --session-idle-s 1e-9
    scanned every session's record back to back, a core kept busy for nothing. It runs at most
    every MIN_PERIOD_S."""
    server = server_factory(session_idle_s=1e-9)
    expiry = server.session_expiry
    sweeps = 0
    sweep = expiry.sweep

    def counted() -> int:
        nonlocal sweeps
        sweeps += 1
        return sweep()

    expiry.sweep = counted  # type: ignore[method-assign]
    started = time.monotonic()
    time.sleep(0.5)
    took = time.monotonic() - started
    assert sweeps <= took / MIN_PERIOD_S + 2, f"{sweeps} sweeps in {took:.2f} s"
