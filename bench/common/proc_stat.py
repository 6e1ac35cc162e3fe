"""A process's CPU seconds from /proc/PID/stat (clock ticks), for every bench that counts the CPU
of processes it did not start in this interpreter (soak's clients, pd's engines, migrate's nodes)."""

from __future__ import annotations

import os

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, tid: int | None = None) -> float | None:
    """User + system CPU seconds of ``pid`` (of its thread ``tid``, when given) so far; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15 of stat(5)
