"""A kvstore-server whose stop hangs says where and ends (--stop-timeout-s): an operator's SIGTERM,
and a test's, never waits for ever, and the stacks of every thread are in stderr. A stop held up
here by a WritePages stream left open (gRPC gives calls in flight a 5 s grace), and cut at 1 ms:
should the stream not have reached the server yet under load, the stop's own fsyncs and thread
joins take longer than that (~30 ms), so the watchdog fires either way."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import grpc
import pytest
from support.servers import ServerProcess

from kvstore._proto import data_pb2_grpc


def _open_stream(address: str) -> tuple[grpc.Channel, grpc.Future]:
    """A WritePages call that sends nothing and never ends (until its channel closes)."""
    channel = grpc.insecure_channel(address)
    call = data_pb2_grpc.DataStub(channel).WritePages.future(iter(lambda: time.sleep(60), 0), timeout=60)
    return channel, call


NODE = "stoptimeout"  # its own node name: the arena a cut stop leaves is this test's to find


def _arenas() -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"kvstore-{NODE}-*"))


def test_a_stop_past_its_timeout_dumps_the_stacks_and_exits(tmp_path: Path) -> None:
    """Like a crash, the cut stop leaves its arena in /dev/shm (64 MiB of RAM); the next start of
    the node on the same directories removes it, takes the directory lock and serves."""
    server = ServerProcess(tmp_path, "--stop-timeout-s", "0.001", "--node", NODE)
    server.start()
    channel, _call = _open_stream(server.address)
    try:
        time.sleep(0.2)  # the stream reaches the server
        began = time.monotonic()
        assert server.proc is not None
        server.proc.send_signal(15)
        code = server.proc.wait(20)
        took = time.monotonic() - began
        stderr = server.proc.stderr.read() if server.proc.stderr is not None else ""
    finally:
        channel.close()
        if server.proc is not None and server.proc.poll() is None:
            server.kill()
    assert code == 1, stderr[-3000:]
    assert took < 4.5, f"the stop was not cut short: {took:.1f} s"
    assert "Timeout" in stderr and "Thread 0x" in stderr and "File " in stderr, stderr[-3000:]
    left = _arenas()
    again = ServerProcess(tmp_path, "--node", NODE)
    try:
        again.start()
        assert not set(left) & set(_arenas()), "the next start kept the arena the cut stop left"
    finally:
        if again.proc is not None:
            assert again.terminate() == 0
        again.close_pipes()
        server.close_pipes()
    assert _arenas() == [], "an arena of the test stayed in /dev/shm"


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_stop_timeout_is_refused(tmp_path: Path, value: str) -> None:
    done = subprocess.run([*ServerProcess(tmp_path).args, "--stop-timeout-s", value], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--stop-timeout-s" in done.stderr, done.stderr


def test_a_stop_says_which_signal_it_took(tmp_path: Path) -> None:
    """The signal is logged by the main thread once it wakes, not inside the handler (which could
    interrupt a log write of that thread: a reentrant write on stderr raises)."""
    server = ServerProcess(tmp_path, "--log-level", "info")
    server.start()
    assert server.proc is not None
    server.proc.send_signal(2)
    try:
        assert server.proc.wait(20) == 0
    finally:
        if server.proc.poll() is None:
            server.kill()
    stderr = server.proc.stderr.read() if server.proc.stderr is not None else ""
    server.close_pipes()
    assert "received SIGINT, shutting down" in stderr and "kvstore-server stopped" in stderr, stderr[-3000:]
