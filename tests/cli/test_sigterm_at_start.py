"""A SIGTERM or SIGINT stops kvstore-server wherever its main thread is when the signal lands: right
after "ready" that thread waits for the signal, and a handler that set a threading.Event there took
the Event's lock, which the main thread holds for a moment each time it enters or leaves its wait.
A signal handled in that moment hung the process for good (nothing logged, later signals too)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from support.servers import ServerProcess, remove_dead_arenas

# kvstore-server's main, run as it is; once "ready" is written the main thread's tracer sends the
# process the signal at the next threading.Condition.wait the main thread enters, with the
# condition's lock held (as in Event.wait): the moment the signal would otherwise have to hit.
_SERVER_SIGNALLED_IN_ITS_WAIT = """
import os, sys
from kvstore.cli import server

def tracer(frame, event, arg):
    if event == "call" and frame.f_code.co_qualname == "Condition.wait":
        sys.settrace(None)
        os.kill(os.getpid(), SIGNUM)

class Out:
    def __init__(self, out):
        self.out = out
    def write(self, text):
        written = self.out.write(text)
        if "ready" in text:
            sys.settrace(tracer)
        return written
    def __getattr__(self, name):
        return getattr(self.out, name)

sys.stdout = Out(sys.stdout)
sys.exit(server.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_taken_inside_the_main_threads_wait_stops_the_server(tmp_path: Path, signum: int) -> None:
    """Bug: a server sent SIGTERM right after "ready" once did not stop within 20 s, stderr empty;
    made certain here, it hung with its main thread in on_signal -> Event.set -> Condition.__enter__
    under Event.wait. The signal is sent again from outside 0.5 s after ready (a server whose main
    thread waits in no Condition after ready takes it then); it must be stopped 10 s later."""
    process = ServerProcess(tmp_path, "--log-level", "info")
    assert process.args[1:3] == ["-m", "kvstore.cli.server"]
    process.args[1:3] = ["-c", _SERVER_SIGNALLED_IN_ITS_WAIT.replace("SIGNUM", str(int(signum)))]
    process.start()
    assert process.proc is not None
    try:
        try:
            code = process.proc.wait(0.5)
        except subprocess.TimeoutExpired:
            process.proc.send_signal(signum)
            code = process.proc.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        remove_dead_arenas()
        pytest.fail(f"kvstore-server did not stop on {signal.Signals(signum).name}: {process.proc.stderr.read()[-3000:]}")
    finally:
        if process.proc.poll() is None:
            process.kill()
        stderr = process.proc.stderr.read() if process.proc.stderr and not process.proc.stderr.closed else ""
        process.close_pipes()
    assert code == 0, stderr[-3000:]
    assert f"received {signal.Signals(signum).name}, shutting down" in stderr and "kvstore-server stopped" in stderr, stderr[-3000:]
