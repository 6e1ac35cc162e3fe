"""Shared fixtures: real servers on 127.0.0.1 with a free port, real LMDB, real files,
a real shared-memory arena. Fixtures only: the helpers tests import are in the ``support``
package (tests/support/), found as a top-level package because pyproject's
[tool.pytest.ini_options] puts tests/ on sys.path (``pythonpath = ["tests"]``); a child process
a test starts that imports it puts tests/ on its own path (PYTHONPATH or sys.path)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# before support's modules are imported: their asserts (ServerProcess.start, tenants' fixtures) report as tests' do
pytest.register_assert_rewrite("support")

from support.kv import SMALL
from support.servers import ServerProcess, make_config, remove_dead_arenas

from kvstore import KVLayout, Namespace
from kvstore.bench.common.harness import KILL_WAIT_S
from kvstore.config import ServerConfig
from kvstore.server import Server


@pytest.fixture(autouse=True, scope="session")
def _children_temp() -> Iterator[None]:
    """Child processes (servers, vLLM engines) make their temp files in a directory of this run,
    removed at its end: a server a test SIGKILLed cannot remove its sockets' directory
    (kvstore/server/socket_dir.py), nor a killed vLLM engine its ZMQ sockets. A short path: a
    socket's address holds ~100 bytes."""
    temp = tempfile.mkdtemp(prefix="kvt-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = temp
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_arena_left() -> Iterator[None]:
    """After each test, the /dev/shm arenas of the servers it killed are gone (nothing left behind)."""
    yield
    remove_dead_arenas()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[object]:
    started: list[Server] = []

    def start(config: ServerConfig | None = None, **kw: object) -> Server:
        server = Server(config or make_config(tmp_path, **kw))
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(grace_s=1)


@pytest.fixture
def server(server_factory: object) -> Server:
    return server_factory()  # type: ignore[operator]


@pytest.fixture
def layout() -> KVLayout:
    return SMALL


@pytest.fixture
def ns(layout: KVLayout) -> Namespace:
    return Namespace(model="demo", revision="r1", layout=layout)


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path)
    yield proc
    if proc.proc is not None and proc.proc.poll() is None:
        proc.proc.kill()
        proc.proc.wait(KILL_WAIT_S)
    proc.close_pipes()


@pytest.fixture
def store_process(server_process: ServerProcess) -> ServerProcess:
    """``server_process``, started (a module with a fixture of this name of its own uses that one)."""
    server_process.start()
    return server_process
