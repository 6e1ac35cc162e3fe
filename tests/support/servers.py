"""Servers for the tests: a ServerConfig on a test's tmp dir (``make_config``), kvstore-server as a
child process (``ServerProcess``, for SIGKILL and restart tests), and stray writes: into a
running server's arena (``flip_arena_byte``), its SSD (``flip_ssd_byte``), a stopped one's SSD
index (``flip_index_byte``). The fixtures that use them are in conftest.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from kvstore.bench.common.harness import KILL_WAIT_S, free_port
from kvstore.config import HostTierConfig, ServerConfig, SsdTierConfig
from kvstore.page import HEADER_BYTES
from kvstore.server import Server
from kvstore.tiers.host import remove_stale_arenas
from support.ssd_pages import edit_index_entry

ENTRY_HEADER_AT = 16  # an SSD index entry's value: offset u64, slot bytes u64, then the page header's core


def make_config(tmp: Path, host_bytes: int = 64 << 20, ssd_bytes: int | None = 256 << 20, **kw: object) -> ServerConfig:
    # Tests store everything they demote (no endurance budget) unless they test admission.
    ssd = SsdTierConfig(directory=tmp / "ssd", capacity_bytes=ssd_bytes, dwpd=0, admission="all") if ssd_bytes else None
    return ServerConfig(
        listen="127.0.0.1:0",
        data_dir=tmp / "data",
        tiers=("host", "ssd") if ssd else ("host",),
        host=HostTierConfig(capacity_bytes=host_bytes),
        ssd=ssd,
        metrics_listen="127.0.0.1:0",
        **{"scrub_pages_per_s": 0.0, **kw},  # type: ignore[arg-type]  # tests scrub by hand
    )


def remove_dead_arenas(shm_dir: Path = Path("/dev/shm")) -> None:
    """Unlinks the arenas of servers that died (a SIGKILLed child leaves its /dev/shm arena, which
    only the next start of its node removes): a test leaves no memory behind."""
    remove_stale_arenas(shm_dir, "*")


def flip_arena_byte(server: Server, offset: int) -> None:
    """A stray write into the server's shared-memory arena, made as a client that maps it would."""
    with open(server.core.arena_of().path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def flip_ssd_byte(server: Server, key: bytes, where: int = 100) -> None:
    """One payload byte of ``key``'s copy on the server's SSD changed (damage on disk)."""
    assert server.config.ssd is not None
    with open(server.config.ssd.directory / "pages.dat", "r+b") as f:
        f.seek(server.core.where(key)["ssd"] + HEADER_BYTES + where)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


def flip_index_byte(ssd_dir: Path, key: bytes, at: int, mask: int) -> None:
    """XORs one byte of ``key``'s SSD index entry (its server is stopped)."""

    def flip(value: bytearray) -> None:
        value[at] ^= mask

    edit_index_entry(ssd_dir, key, flip)


def _thread_state(task: Path) -> str:
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "T"  # the thread ended: it answers nothing


def _tasks(tasks: Path, proc: subprocess.Popen[str]) -> list[Path]:
    try:
        return list(tasks.iterdir())
    except FileNotFoundError:  # a process that ended (a zombie's task directory cannot be listed)
        raise AssertionError(f"process {proc.pid} ended while it was being frozen") from None


def freeze(proc: subprocess.Popen[str]) -> None:
    """SIGSTOP, returning once every thread is stopped: kill() only queues the signal. The thread
    the kernel picks to take it (the main one) starts the group stop once it runs; until then the
    others run on, and a request sent right after kill() can still be answered (seen under load:
    a frozen cluster node served a fetched page)."""
    assert proc.poll() is None, f"process {proc.pid} exited ({proc.returncode}) before it could be frozen"
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    tasks = Path(f"/proc/{proc.pid}/task")
    while not all(_thread_state(t) in "Tt" for t in _tasks(tasks, proc)):
        assert time.monotonic() < deadline, f"process {proc.pid} did not stop within 10 s of SIGSTOP"
        time.sleep(0.001)


class ServerProcess:
    """kvstore-server as a child process (for SIGKILL and restart tests)."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.args = [
            sys.executable, "-m", "kvstore.cli.server", "--listen", f"127.0.0.1:{self.port}", "--data-dir", str(tmp / "data"),
            "--ssd-dir", str(tmp / "ssd"), "--host-capacity", "64MiB", "--ssd-capacity", "256MiB", "--metrics-listen", "off",
            "--log-level", "warning", "--ssd-dwpd", "0", "--ssd-admission", "all", *extra,
        ]
        self.proc: subprocess.Popen[str] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, preexec_fn: object = None) -> None:
        self.close_pipes()  # of the run before a restart
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=preexec_fn)  # type: ignore[arg-type]  # noqa: PLW1509 - a test's fork hook, no threads yet
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "ready" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line}{self.proc.stderr.read() if self.proc.stderr else ''}")

    def freeze(self) -> None:
        """SIGSTOP, returning once every thread is stopped (``freeze``): a request sent right after
        kill() over the call socket (~20 us) can still be answered."""
        assert self.proc is not None
        freeze(self.proc)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(KILL_WAIT_S)

    def terminate(self) -> int:
        """SIGTERM and the exit code; a stop that fails or hangs fails with the server's stderr
        (the stacks a hung stop writes at --stop-timeout-s)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(KILL_WAIT_S)
            raise AssertionError(f"the server did not stop within 20 s of SIGTERM:\n{self._stderr_tail()}") from None
        if code != 0:
            print(f"the server exited {code} on SIGTERM:\n{self._stderr_tail()}", file=sys.stderr)
        return code

    def _stderr_tail(self) -> str:
        """The last 20,000 characters of a stopped server's stderr (nothing if it was read already)."""
        assert self.proc is not None
        return self.proc.stderr.read()[-20_000:] if self.proc.stderr is not None and not self.proc.stderr.closed else ""

    def close_pipes(self) -> None:
        """Closes this side of the last run's stdout and stderr (a run's pipes outlive it otherwise)."""
        if self.proc is not None:
            for pipe in (self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    pipe.close()
