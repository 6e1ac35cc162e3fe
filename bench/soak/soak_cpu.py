"""CPU time the server and the clients spent over a soak phase's measured window, per op.

On two cores shared by 16 client processes and the server, ops/s moves 15-30% from one
stretch to the next, so a few per cent of cost is hard to see in it. CPU seconds per op are
steadier: they count the work one operation costs, wherever the scheduler put it. Read from
/proc/PID/stat (utime + stime, every thread of the process) when the window opens and at its
last sample, for the server and for each client process.
"""

from __future__ import annotations

from typing import Any

from kvstore.bench.common.proc_stat import cpu_seconds


class Window:
    """CPU seconds of the server and of the clients between the window's opening and its end."""

    def __init__(self, server_pid: int, client_pids: list[int], opens_at: float) -> None:
        self.server_pid, self.client_pids, self.opens_at = server_pid, client_pids, opens_at
        self._first: tuple[float, float, float] | None = None  # (wall clock, server s, clients s)
        self._last: tuple[float, float, float] | None = None

    def _read(self, now: float) -> tuple[float, float, float] | None:
        server = cpu_seconds(self.server_pid)
        clients = [cpu_seconds(pid) for pid in self.client_pids]
        if server is None or any(c is None for c in clients):
            return None
        return now, server, sum(c for c in clients if c is not None)

    def tick(self, now: float) -> None:
        """One sample (soak.py calls it every second of the phase)."""
        if now < self.opens_at:
            return
        reading = self._read(now)
        if reading is None:
            return
        if self._first is None:
            self._first = reading
        self._last = reading

    def summary(self, ops_per_s: float) -> dict[str, Any]:
        """CPU seconds over the window and milliseconds per op at the phase's ``ops_per_s``."""
        if self._first is None or self._last is None or self._last[0] <= self._first[0] or not ops_per_s:
            return {"window_s": None, "server_cpu_s": None, "clients_cpu_s": None,
                    "server_ms_per_op": None, "clients_ms_per_op": None}
        seconds = self._last[0] - self._first[0]
        server, clients = self._last[1] - self._first[1], self._last[2] - self._first[2]
        ops = ops_per_s * seconds
        return {"window_s": round(seconds, 3), "server_cpu_s": round(server, 2), "clients_cpu_s": round(clients, 2),
                "server_ms_per_op": round(server / ops * 1e3, 4), "clients_ms_per_op": round(clients / ops * 1e3, 4)}
