"""CPU seconds per GB of every process on a data path, beside its raw floor's (README, "CPU per GB beside the floor").

On a 2-core host a wall-clock ratio measures core contention as much as our code; the CPU
all processes together spend per GB delivered does not depend on the core count, so it
predicts the bigger hosts engines run on. The floor is the least work a verified byte
needs: the raw transport (memcpy, a bare pump, an O_DIRECT read) plus the one copy and/or
one xxh3 pass that checking it costs, measured in the same run.

More: bench/common/README.md (### cpu_floor.py).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import psutil

from kvstore import pagecopy
from kvstore.bench.common.proc_stat import cpu_seconds

OWN = os.getpid()


def process_cpu_s(pid: int, tree: bool = False) -> float:
    """CPU seconds ``pid`` has used (0 once it is gone); ``tree``: with its descendants
    (a pump that runs its sender in a child of its own)."""
    if pid == OWN:
        return time.process_time()
    pids = [pid]
    if tree:
        try:
            pids += [child.pid for child in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return sum(_cpu_clock_s(p) for p in pids)


def _cpu_clock_s(pid: int) -> float:
    """CPU seconds of process ``pid``, all its threads, to the ns where Linux's process CPU
    clock can be read (clockid ``~pid << 3 | 2``: CPUCLOCK_SCHED of the whole process), else
    in clock ticks from /proc; 0 once it is gone."""
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except (OSError, OverflowError):
        return cpu_seconds(pid) or 0.0


class Meter:
    """CPU seconds of named processes between ``start()`` and ``stop()``. ``trees``: the
    names whose descendants count too."""

    def __init__(self, pids: dict[str, int], trees: frozenset[str] = frozenset()) -> None:
        self.pids, self.trees = pids, trees
        self._before: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        return {name: process_cpu_s(pid, name in self.trees) for name, pid in self.pids.items()}

    def start(self) -> None:
        self._before = self._read()

    def stop(self) -> dict[str, float]:
        return {name: max(0.0, t - self._before[name]) for name, t in self._read().items()}


def threads_cpu_s(pid: int, prefixes: tuple[str, ...]) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` whose OS name (``comm``) begins with one of
    ``prefixes``, by thread id: to the ns from /proc's schedstat, in clock ticks from its stat
    where the kernel keeps no schedstat; {} once the process is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return {}
    out: dict[int, float] = {}
    for tid in tids:
        task = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{task}/comm") as f:
                if not f.read().strip().startswith(prefixes):
                    continue
            with open(f"{task}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile, or the kernel keeps no schedstat
            ticks = cpu_seconds(pid, int(tid))
            if ticks is not None:
                out[int(tid)] = ticks
    return out


class ThreadMeter:
    """CPU seconds of one process's threads named as ``prefixes`` say, between ``start()`` and
    ``stop()``; a thread started meanwhile counts from 0 (a pool starts its worker at its first
    task), one that ended meanwhile is lost (the server's demotion threads run until it stops)."""

    def __init__(self, pid: int, prefixes: tuple[str, ...]) -> None:
        self.pid, self.prefixes = pid, prefixes
        self._before: dict[int, float] = {}

    def start(self) -> None:
        self._before = threads_cpu_s(self.pid, self.prefixes)

    def stop(self) -> float:
        after = threads_cpu_s(self.pid, self.prefixes)
        return sum(max(0.0, t - self._before.get(tid, 0.0)) for tid, t in after.items())


def add_cpu(total: dict[str, float], used: dict[str, float]) -> None:
    for name, seconds in used.items():
        total[name] = total.get(name, 0.0) + seconds


class _Pages:
    """A buffer cut in page-sized pieces, worked on by ``threads`` threads as the client's
    copy pool does (each piece's work releases the GIL)."""

    def __init__(self, nbytes: int, page_bytes: int, threads: int) -> None:
        self.spans = [(off, min(off + page_bytes, nbytes)) for off in range(0, nbytes, page_bytes)]
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="floor")

    def each(self, work: Callable[[int, int], int]) -> list[int]:
        return list(self.pool.map(lambda span: work(*span), self.spans))

    def close(self) -> None:
        self.pool.shutdown()


class VerifiedCopy(_Pages):
    """One verified copy: every page of ``src`` copied into ``dst`` (a buffer touched once
    beforehand, as an engine's KV or an arena slot is; one of its own if None) and hashed in the same pass (``pagecopy.copy_checksum``:
    the fused native copy where built, else numpy's copy then xxh3)."""

    def __init__(self, src: Any, page_bytes: int, threads: int = 2, dst: Any = None) -> None:
        self.src = np.frombuffer(src, dtype=np.uint8)
        self.dst = np.zeros_like(self.src) if dst is None else np.frombuffer(dst, dtype=np.uint8)
        assert len(self.dst) == len(self.src)
        super().__init__(len(self.src), page_bytes, threads)

    def run(self) -> list[int]:
        """Each page's checksum."""
        return self.each(lambda a, b: pagecopy.copy_checksum_bytes(self.dst[a:b], self.src[a:b]))


class HashPass(_Pages):
    """One xxh3 pass over ``data``, page by page, with the GIL released."""

    def __init__(self, data: Any, page_bytes: int, threads: int = 2) -> None:
        self.data = np.frombuffer(data, dtype=np.uint8)
        super().__init__(len(self.data), page_bytes, threads)

    def run(self) -> list[int]:
        """Each page's checksum."""
        return self.each(lambda a, b: pagecopy.checksum_released(self.data[a:b]))

    def close(self) -> None:
        super().close()
        self.data = np.empty(0, dtype=np.uint8)  # lets the owner close an mmap it hashed


def _per_gb(cpu: dict[str, float], gigabytes: float) -> dict[str, float]:
    return {name: round(seconds / gigabytes, 4) for name, seconds in cpu.items()}


def cpu_fields(moved_bytes: int, path_cpu: dict[str, float], floor_cpu: dict[str, float]) -> dict[str, Any]:
    """The CPU columns of one row: ``path_cpu`` and ``floor_cpu`` are CPU seconds per
    process summed over rounds that moved ``moved_bytes`` in all (each). ``cpu_ratio`` is
    the path's CPU per GB over the floor's (None if the floor used no measurable CPU)."""
    gigabytes = moved_bytes / 1e9
    path, floor = sum(path_cpu.values()) / gigabytes, sum(floor_cpu.values()) / gigabytes
    return {"cpu_s_per_gb": round(path, 4), "cpu_s_per_gb_by_process": _per_gb(path_cpu, gigabytes),
            "floor_cpu_s_per_gb": round(floor, 4), "floor_cpu_s_per_gb_by_process": _per_gb(floor_cpu, gigabytes),
            "cpu_ratio": round(path / floor, 3) if floor > 0 and math.isfinite(path / floor) else None}


def _by_process(row: dict[str, Any], key: str) -> str:
    """``a 0.12 + c 0.30`` for a table cell."""
    return " + ".join(f"{name} {v:.2f}" for name, v in row[key].items())


def print_cpu_rows(rows: list[dict[str, Any]], path_width: int, floor_width: int) -> None:
    """The table of ``cpu_fields`` rows (with ``path``, ``gbps``, ``floor``, ``floor_gbps``): the
    path's CPU per GB beside its floor's, ``cpu_ratio``, and both by process."""
    print(f"{'path':<{path_width}} {'GB/s':>7} {'CPU s/GB':>8}  {'floor':<{floor_width}} {'GB/s':>7} {'CPU s/GB':>8} "
          f"{'cpu_ratio':>9}   by process (path | floor)")
    for r in rows:
        ratio = f"{r['cpu_ratio']:.2f}" if r["cpu_ratio"] is not None else "-"
        print(f"{r['path']:<{path_width}} {r['gbps']:>7.2f} {r['cpu_s_per_gb']:>8.3f}  {r['floor']:<{floor_width}} "
              f"{r['floor_gbps']:>7.2f} {r['floor_cpu_s_per_gb']:>8.3f} {ratio:>9}   "
              f"{_by_process(r, 'cpu_s_per_gb_by_process')} | {_by_process(r, 'floor_cpu_s_per_gb_by_process')}")
