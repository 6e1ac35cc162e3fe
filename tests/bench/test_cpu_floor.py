"""cpu_floor: CPU seconds per GB of a path's processes beside its floor's. Correctness only, no timing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np

from kvstore.bench.common.cpu_floor import OWN, HashPass, Meter, ThreadMeter, VerifiedCopy, cpu_fields
from kvstore.page import checksum
from kvstore.server.placement.background import name_thread


def test_the_meter_counts_a_child_of_a_tree_and_this_process() -> None:
    """A pump runs its sender in a child of its own: with ``trees`` its CPU counts."""
    code = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', "
            "'import time\\nend = time.process_time() + 0.3\\nwhile time.process_time() < end: pass\\ntime.sleep(60)']); "
            "print(flush=True); c.wait()")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        parent.stdout.readline()  # the child is started
        flat, tree = Meter({"pump": parent.pid, "me": OWN}), Meter({"pump": parent.pid}, trees=frozenset({"pump"}))
        flat.start()
        tree.start()
        sum(range(2_000_000))  # some CPU of this process
        deadline = 50
        while tree.stop()["pump"] < 0.2 and deadline:
            subprocess.run(["sleep", "0.1"], check=True)
            deadline -= 1
        used = flat.stop()
        assert used["me"] > 0 and used["pump"] < 0.1, used  # the parent itself only waits
        assert tree.stop()["pump"] >= 0.2
    finally:
        parent.kill()
        parent.wait()


def test_a_verified_copy_lands_every_byte_and_a_hash_pass_reads_them() -> None:
    src = np.random.default_rng(1).integers(0, 256, 10 * 4096 + 123, dtype=np.uint8)  # a short last page
    copy, hashed = VerifiedCopy(src, 4096), HashPass(src, 4096)
    try:
        copied = copy.run()
        assert checksum(copy.dst) == checksum(src)
        pages = [checksum(src[off : off + 4096]) for off in range(0, len(src), 4096)]
        assert copied == pages and hashed.run() == pages  # every page, the short last one too, hashed once
    finally:
        copy.close()
        hashed.close()


def test_the_cpu_columns_are_seconds_per_gb_and_their_ratio() -> None:
    row = cpu_fields(2_000_000_000, {"client": 1.0, "server": 3.0}, {"client": 1.0})
    assert row["cpu_s_per_gb"] == 2.0 and row["cpu_s_per_gb_by_process"] == {"client": 0.5, "server": 1.5}
    assert row["floor_cpu_s_per_gb"] == 0.5 and row["cpu_ratio"] == 4.0
    assert cpu_fields(1_000_000_000, {"client": 1.0}, {"client": 0.0})["cpu_ratio"] is None  # no measurable floor


def test_the_meter_reads_another_process_finer_than_a_clock_tick() -> None:
    """/proc/PID/stat counts in clock ticks (10 ms): a server that spent ~1 ms on a get read 0 or
    10 ms per window (a smoke run reported server 0.00 s/GB for host-shm-get; 10 gets of ~1.2 ms
    of server CPU each summed to 20 ms). A burst of 3 ms of CPU in another process must read as
    such."""
    code = ("import sys, time\n"
            "print(flush=True)\n"
            "for line in sys.stdin:\n"
            "    end = time.process_time() + 0.003\n"
            "    while time.process_time() < end: pass\n"
            "    print(flush=True)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdin is not None and child.stdout is not None
        child.stdout.readline()  # started: its start-up CPU is not in a window
        readings = []
        for _ in range(5):
            meter = Meter({"child": child.pid})
            meter.start()
            child.stdin.write("burn\n")
            child.stdin.flush()
            child.stdout.readline()
            readings.append(meter.stop()["child"])
        assert all(0.002 <= seconds < 0.008 for seconds in readings), readings
    finally:
        child.kill()
        child.wait()


def test_a_thread_meter_counts_the_named_threads_only_and_those_started_meanwhile() -> None:
    """ThreadMeter (kvstore-bench lookup's meter of the demoter's CPU) sums the CPU of a process's
    threads by their OS name: a thread named for it and started after start() counts from 0,
    another busy thread of the same process not at all."""
    spun, done = threading.Barrier(3), threading.Event()

    def spin(name: str) -> None:
        name_thread(name)
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        spun.wait()
        done.wait()  # alive while the meter reads: a thread that ended is lost to it

    meter = ThreadMeter(os.getpid(), ("kv-test-meter",))
    meter.start()
    threads = [threading.Thread(target=spin, args=(name,)) for name in ("kv-test-meter", "kv-other")]
    for thread in threads:
        thread.start()
    spun.wait(30)
    used = meter.stop()
    done.set()
    for thread in threads:
        thread.join()
    assert 0.15 <= used <= 0.25, f"{used} s: the named thread spun 0.2 s of CPU, the other as much"
