"""kvstore-server freezes its start-up heap (kvstore/cli/server.py, gc.freeze after start):
what start-up made lives as long as the process, and a full collection that walked it all
stalled every thread, a lookup's too, 30-50 ms at a time."""

from __future__ import annotations

import signal
from pathlib import Path

from support.servers import ServerProcess

# kvstore-server's main, with one more signal: SIGUSR1 prints the frozen object count.
_SERVER_THAT_TELLS = """
import gc, signal, sys
from kvstore.cli import server
signal.signal(signal.SIGUSR1, lambda *_: print(f"frozen {gc.get_freeze_count()}", flush=True))
sys.exit(server.main(sys.argv[1:]))
"""


def test_a_started_server_has_frozen_its_start_up_heap(tmp_path: Path) -> None:
    """Was untested: removing the gc.freeze() call failed no test (now: '0 objects frozen')."""
    process = ServerProcess(tmp_path)
    assert process.args[1:3] == ["-m", "kvstore.cli.server"]
    process.args[1:3] = ["-c", _SERVER_THAT_TELLS]
    process.start()  # returns on "ready": after start() and the freeze
    try:
        assert process.proc is not None and process.proc.stdout is not None
        process.proc.send_signal(signal.SIGUSR1)
        line = process.proc.stdout.readline()
        assert line.startswith("frozen "), line
        frozen = int(line.split()[1])
        assert frozen > 10_000, f"{frozen} objects frozen: start-up's heap (modules, directory) stays in the GC's walk"
    finally:
        assert process.terminate() == 0
