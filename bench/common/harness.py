"""Starting real processes for benchmarks: kvstore-server and the raw gRPC pump."""

from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by rank (nan for none): the lookup rows' and their floor's."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


_handed: collections.deque[int] = collections.deque(maxlen=4096)
KILL_WAIT_S = 60.0  # how long a SIGKILLed child may take to be reaped: seen past 10 s on a loaded 2-core host


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _worker_share() -> tuple[int, int]:
    """(this process's index, how many): the pytest-xdist workers of one test run each pick from their own
    share of the ports (``port % how_many == index``); (0, 1) elsewhere."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        return int(worker[2:]) % int(count), int(count)
    return 0, 1


def free_port() -> int:
    """A loopback port free now, outside the kernel's ephemeral range and not handed out lately by this process.
    bind(0) answers from the ephemeral range, where any outgoing connection may take the port before the child
    it was meant for binds it (CI saw etcd fail so); a port below that range is taken only by a bind naming it.
    Test workers pick from disjoint shares: two of them handed the same free port, the second child's bind
    failed ("address already in use", seen with 4 workers)."""
    low, high = _ephemeral_range()
    below, above = max(0, low - 10000), max(0, 65535 - high)
    index, count = _worker_share()
    for _ in range(64 * count if below + above else 0):
        pick = random.randrange(below + above)
        port = 10000 + pick if pick < below else high + 1 + pick - below
        if port in _handed or port % count != index:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.append(port)
        return port
    with socket.socket() as s:  # no room outside the ephemeral range (a host that made it the whole space)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A new directory for one run's servers and etcd, removed when the run ends well; kept
    when it raised (its logs say why), and named on stderr then."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        print(f"the run's files (server and etcd logs) are kept in {path}", file=sys.stderr)
        raise
    shutil.rmtree(path, ignore_errors=True)


def stop_process(proc: subprocess.Popen[Any] | None, timeout_s: float = 30.0) -> None:
    """Stops a child for good: resumes it first (a test may have SIGSTOPped it, and a stopped
    process cannot act on SIGTERM), SIGTERM, ``timeout_s`` to exit, then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(KILL_WAIT_S)


class Process:
    """A child process that prints one 'ready' line when it serves. Its stderr goes to a
    temporary file, not a pipe: a pipe nobody reads fills, and a chatty server then blocks."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     env={**os.environ, **env} if env else None)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "ready" not in line:
            self.proc.kill()
            self.proc.wait(KILL_WAIT_S)
            raise RuntimeError(f"{args[2]} did not start: {line}{self.stderr_text()}")

    def stderr_text(self) -> str:
        """What the process wrote on stderr so far."""
        self.stderr.seek(0)
        return self.stderr.read()

    def stop(self) -> None:
        stop_process(self.proc)
        self.stderr.close()


def start_server(workdir: Path, host_bytes: int, ssd_bytes: int, *extra: str,
                 env: dict[str, str] | None = None) -> tuple[Process, str]:
    """kvstore-server on a free loopback port; ``extra`` flags, ``env`` added to the environment."""
    port = free_port()
    args = [
        sys.executable, "-m", "kvstore.cli.server", "--listen", f"127.0.0.1:{port}", "--data-dir", str(workdir / "data"),
        "--ssd-dir", str(workdir / "ssd"), "--host-capacity", str(host_bytes), "--ssd-capacity", str(ssd_bytes),
        "--metrics-listen", "off", "--log-level", "warning", *extra,
    ]
    return Process(args, env), f"127.0.0.1:{port}"


def start_raw_grpc() -> tuple[Process, str]:
    port = free_port()
    return Process([sys.executable, "-m", "kvstore.bench.common.rawgrpc", "--port", str(port)]), f"127.0.0.1:{port}"


def rss(pid: int) -> dict[str, int]:
    """A process's resident memory in bytes: ``rss`` (VmRSS) and its parts ``anon`` (heap),
    ``file`` (mapped files, e.g. LMDB) and ``shmem`` (the shared-memory arena)."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in fields:
                out[fields[name]] = int(value.split()[0]) * 1024
    return out


def exit_now(code: int) -> NoReturn:
    """Ends the process as the interpreter's exit does, less its teardown of every module and
    object: 1-2.5 s once torch or vLLM is imported, which every run (and every smoke test's
    subprocess) waited for. Non-daemon threads are joined and the atexit handlers run (logging's
    flush, multiprocessing's children, weakref finalizers: vLLM's engine shutdown, temporary
    directories), then the standard streams are flushed and the process exits with ``code``."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit: its threads end first
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
