"""The demoter's two halves (demoter.py): by default the background half and the verifier
of its batches run in Linux's idle class, so a drain nobody waits for takes no CPU from a
lookup; an allocation that finds no room (it evicted inline: the background half lags)
wakes the urgent half, a normal thread at --demote-nice, which drains with it."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import threading
import time
from pathlib import Path

from support.servers import make_config

from kvstore.bench.common.harness import KILL_WAIT_S
from kvstore.config import ServerConfig
from kvstore.page import LayoutDesc, checksum
from kvstore.server.placement import Demoter, Placement
from kvstore.server.placement.background import lift

LAYOUT = LayoutDesc(4, 2, 2, 64, "float16", 16)  # 32 KiB pages: 128 of them fill a 4 MiB host tier
NS = b"demoter-halves!!"


def _keys(start: int, n: int) -> list[bytes]:
    return [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(start, start + n)]


def _put(core: Placement, keys: list[bytes]) -> None:
    for key in keys:  # one page per allocation: the fill crosses a watermark at a known page
        alloc, slots = core.allocate(NS, LAYOUT, [key])
        payload = key * (LAYOUT.page_bytes // len(key))
        core.slot_view(alloc, slots[0][0])[:] = payload
        assert core.commit(alloc, [key], [checksum(payload)]) == 1


def _config(tmp_path: Path, **host: object) -> ServerConfig:
    config = make_config(tmp_path, host_bytes=4 << 20, ssd_bytes=16 << 20)
    return dataclasses.replace(config, host=dataclasses.replace(config.host, demote_above=0.5, demote_to=0.25, **host))


def _nice_of_thread(native_id: int) -> int:
    """The OS niceness of this process's thread ``native_id`` (/proc, field 19)."""
    return int(Path(f"/proc/{os.getpid()}/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()[16])


def _callers(core: Placement) -> list[str]:
    """Records the name of each thread that runs a demotion round that writes (observes, changes nothing)."""
    names: list[str] = []
    demote_one = core.demote_one

    def recorded() -> bool:
        went = demote_one()
        if went:
            names.append(threading.current_thread().name)
        return went

    core.demote_one = recorded  # type: ignore[method-assign]
    return names


def _wait_drained(core: Placement, pages: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while core.view().tiers["ssd"].num_pages < pages and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.view().tiers["ssd"].num_pages >= pages


def test_by_default_the_background_half_and_its_verifier_are_idle_class_and_the_urgent_half_is_normal_at_demote_nice(tmp_path) -> None:
    before = {t.native_id for t in threading.enumerate()}  # before the core: it starts the foreground verifier
    core = Placement(_config(tmp_path, demote_nice=7))
    demoter = Demoter(core, idle_s=0.02)
    demoter.start()
    try:
        _put(core, _keys(0, 80))  # past the high watermark (64 pages): the background half drains, its batches verified
        _wait_drained(core, 48)
        ours = {t.name: t.native_id for t in threading.enumerate() if t.native_id not in before}
        classes = {name: os.sched_getscheduler(tid) for name, tid in ours.items() if tid is not None}
        assert classes["demoter"] == os.SCHED_IDLE
        assert [c for name, c in classes.items() if name.startswith("kv-verify-behind")] == [os.SCHED_IDLE]
        foreground = [c for name, c in classes.items() if name.startswith("kv-verify_")]
        assert foreground and all(c == os.SCHED_OTHER for c in foreground), classes  # durable puts' and inline evictions'
        assert classes["demoter-urgent"] == os.SCHED_OTHER
        urgent = ours["demoter-urgent"]
        assert urgent is not None
        deadline = time.monotonic() + 5  # the thread sets its own priority as it starts
        while _nice_of_thread(urgent) != 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _nice_of_thread(urgent) == 7
        assert os.sched_getscheduler(0) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, 0) == 0  # the caller: untouched
        # named for the OS (top -H, ps -L; kvstore-bench lookup meters the demotion threads' CPU by these names)
        comms = {name: Path(f"/proc/self/task/{tid}/comm").read_text().strip() for name, tid in ours.items()}
        assert (comms["demoter"], comms["demoter-urgent"]) == ("kv-demoter", "kv-demoter-urg"), comms
        assert sorted(c for name, c in comms.items() if name.startswith("kv-verify")) == ["kv-verify", "kv-verify-bg"], comms
    finally:
        demoter.stop()
        core.close()


def test_a_drain_no_allocation_waits_for_is_written_by_the_background_half_alone(tmp_path) -> None:
    """Past the high watermark with room to spare: nobody waits for the drain, so it all
    runs in the idle class (the draining row of kvstore-bench lookup)."""
    core = Placement(_config(tmp_path))
    callers = _callers(core)
    demoter = Demoter(core, idle_s=0.02)
    demoter.start()
    try:
        _put(core, _keys(0, 80))
        _wait_drained(core, 48)
        assert not core.starved.is_set()
        demoter.stop()  # the round under way ends first: its pages are indexed before it is recorded (an
        # idle-class thread on a busy host can sit between the two for long)
        assert callers and set(callers) == {"demoter"}, callers
    finally:
        demoter.stop()
        core.close()


def test_an_allocation_that_finds_no_room_wakes_the_urgent_half(tmp_path) -> None:
    """The host tier filled with no demoter running: allocations evicted inline, one page
    and one sync each. That says the background half lags, and the urgent one drains."""
    core = Placement(_config(tmp_path))
    callers = _callers(core)
    _put(core, _keys(0, 160))  # 128 fit: the last 32 allocations each wrote a victim down themselves
    assert core.starved.is_set()
    demoter = Demoter(core, idle_s=0.02)
    demoter.start()
    try:
        deadline = time.monotonic() + 20
        while "demoter-urgent" not in callers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "demoter-urgent" in callers, callers
        _wait_drained(core, 128 - 32)  # down to the low watermark (a quarter of 128 pages)
    finally:
        demoter.stop()
        core.close()


def test_with_demote_sched_normal_one_demoter_runs_at_demote_nice(tmp_path) -> None:
    core = Placement(_config(tmp_path, demote_sched="normal", demote_nice=7))
    demoter = Demoter(core, idle_s=0.02)
    before = {t.native_id for t in threading.enumerate()}
    demoter.start()
    try:
        ours = {t.name: t.native_id for t in threading.enumerate() if t.native_id not in before}
        assert "demoter-urgent" not in ours and ours["demoter"] is not None
        deadline = time.monotonic() + 5
        while _nice_of_thread(ours["demoter"]) != 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _nice_of_thread(ours["demoter"]) == 7 and os.sched_getscheduler(ours["demoter"]) == os.SCHED_OTHER
    finally:
        demoter.stop()
        core.close()


def test_where_the_os_refuses_the_idle_class_the_background_half_runs_at_demote_nice(tmp_path, monkeypatch) -> None:
    """A container whose seccomp profile refuses sched_setscheduler (the fake: the refusal
    itself) must not leave the demoter at the foreground's priority, below what
    --demote-nice gave before the idle class existed."""

    def refused(*_: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    before = {t.native_id for t in threading.enumerate()}
    core = Placement(_config(tmp_path, demote_nice=7))
    demoter = Demoter(core, idle_s=0.02)
    demoter.start()
    try:
        ours = {t.name: t.native_id for t in threading.enumerate() if t.native_id not in before}
        assert ours["demoter"] is not None
        deadline = time.monotonic() + 5
        while _nice_of_thread(ours["demoter"]) != 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _nice_of_thread(ours["demoter"]) == 7
    finally:
        demoter.stop()
        core.close()


def _wait_class(native_id: int, policy: int) -> bool:
    deadline = time.monotonic() + 10
    while os.sched_getscheduler(native_id) != policy:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_stop_lifts_the_idle_class_threads_it_waits_for(tmp_path) -> None:
    """A stop waits for the background half's round and the idle verifier's checks; in the idle
    class they run only on CPU nobody else wants, so on a busy host the stop hung (a CI run's
    server took over 20 s to stop). As a privileged process (these tests run as root) the stop
    first puts them back in the normal class."""
    assert os.geteuid() == 0, "lifting a thread out of the idle class needs CAP_SYS_NICE"
    core = Placement(_config(tmp_path))
    demoter = Demoter(core, idle_s=0.02)
    in_round, release, tids = threading.Event(), threading.Event(), []
    demote_one = core.demote_one

    def held() -> bool:
        if threading.current_thread().name == "demoter" and not release.is_set():
            tids.append(threading.get_native_id())
            in_round.set()
            release.wait(30)
        return demote_one()

    core.demote_one = held  # type: ignore[method-assign]
    demoter.start()
    stopping = threading.Thread(target=demoter.stop)
    try:
        assert in_round.wait(10)
        assert os.sched_getscheduler(tids[0]) == os.SCHED_IDLE
        stopping.start()
        assert _wait_class(tids[0], os.SCHED_OTHER), "the stop left the demoter's round in the idle class"
    finally:
        release.set()
        stopping.join(30)
    behind = core.moves._behind_verifier
    busy, go = threading.Event(), threading.Event()
    verifier_tid = behind.submit(lambda: (busy.set(), go.wait(30), threading.get_native_id())[-1])
    closing = threading.Thread(target=core.close)
    try:
        assert busy.wait(10)
        tid = core.moves._behind_tids[0]
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        closing.start()
        assert _wait_class(tid, os.SCHED_OTHER), "the close left the idle verifier in the idle class"
    finally:
        go.set()
        closing.join(30)
    assert verifier_tid.result(10) == tid


def test_a_lift_leaves_a_thread_of_another_process_alone() -> None:
    """A thread's id outlives it (``Thread.native_id``; a second stop, or a thread that ended
    as the stop woke it) and Linux hands it out again, to any process: a root server's lift
    must not put another process's idle or niced thread in the normal class."""
    other = subprocess.Popen(["sleep", "30"])
    try:
        os.sched_setscheduler(other.pid, os.SCHED_IDLE, os.sched_param(0))
        lift(other.pid)
        assert os.sched_getscheduler(other.pid) == os.SCHED_IDLE, "the lift changed another process's thread"
    finally:
        other.kill()
        other.wait(KILL_WAIT_S)
