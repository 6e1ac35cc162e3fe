"""A Server whose start() raises (a --listen port taken, a metrics port taken) leaves nothing
behind in its process: no arena in /dev/shm, no thread of its own, the data directory free
for the next server. An embedding program (a test, a bench, an engine starting a server of its
own) retries in the same process; before, the retry was refused "--data-dir ... is in use by
another kvstore-server (pid <its own pid>)" and the arena stayed until the process ended."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from support.servers import make_config

from kvstore.errors import ConfigError
from kvstore.server import Server


@pytest.mark.parametrize("taken", ["listen", "metrics_listen"])
def test_a_start_that_fails_leaves_nothing_and_a_retry_starts(tmp_path: Path, taken: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"127.0.0.1:{held.getsockname()[1]}"
        threads, shm = set(threading.enumerate()), set(os.listdir("/dev/shm"))
        server = Server(dataclasses.replace(make_config(tmp_path), **{taken: address}))
        with pytest.raises(ConfigError, match="cannot bind"):
            server.start()
        ours = {name for name in set(os.listdir("/dev/shm")) - shm if f"-{os.getpid()}-" in name}  # tiers/host.py's names
        assert ours == set(), "the arena of a server that did not start stayed"  # (another process's may come meanwhile)
        deadline = time.monotonic() + 5.0  # a thread told to stop may still be on its way out
        while (left := [t.name for t in set(threading.enumerate()) - threads if t.is_alive()]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left == [], f"threads of a server that did not start: {left}"
    again = Server(make_config(tmp_path))  # the same data directory, the same process
    again.start()
    try:
        assert again.port > 0
    finally:
        again.stop(grace_s=1)
