"""What the server leaves on the host: private files and directories, and no arena of a
dead server in /dev/shm."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

from support.kv import random_kv
from support.servers import ServerProcess, make_config

from kvstore.bench.common.harness import KILL_WAIT_S
from kvstore.client import KVStoreClient


def _modes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root.parent)): f"{stat.S_IMODE(p.stat().st_mode):o}" for p in [root, *root.rglob("*")]}


async def test_data_files_are_0600_in_0700_directories(server_factory, tmp_path, layout, ns) -> None:
    """Bug: wal.lmdb (it holds prompt tokens), directory.lmdb and index.lmdb were 0644
    files in 0755 directories, readable by every user of the host."""
    server = server_factory()
    tokens = list(range(64))
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, random_kv(layout, len(tokens)), durable=True) == len(tokens)
        await client.session("s").start(tokens)
    modes = {**_modes(tmp_path / "data"), **_modes(tmp_path / "ssd")}
    assert {"data/wal.lmdb/data.mdb", "data/directory.lmdb/data.mdb", "ssd/index.lmdb/data.mdb", "ssd/pages.dat"} <= set(modes)
    loose = {name: mode for name, mode in modes.items() if mode != ("700" if (tmp_path / name).is_dir() else "600")}
    assert loose == {}
    assert stat.S_IMODE(Path(server.core.arena_of().path).stat().st_mode) == 0o600, "the arena too"


def _arena_of(node: str) -> Path:
    (path,) = Path("/dev/shm").glob(f"kvstore-{node}-*")
    return path


def test_arena_of_a_killed_server_is_removed_even_while_its_pid_exists(server_factory, tmp_path) -> None:
    """Bug: staleness was judged by kill(pid, 0), so the 64 MiB arena of a SIGKILLed server
    stayed in /dev/shm whenever its pid still existed (here: an unreaped zombie; elsewhere
    the pid reused by another process). A live server's arena must stay."""
    node = f"t{uuid.uuid4().hex[:8]}"
    live, dead = ServerProcess(tmp_path / "live", "--node", node), ServerProcess(tmp_path / "dead", "--node", node)
    try:
        live.start()
        live_arena = _arena_of(node)
        dead.start()
        (dead_arena,) = set(Path("/dev/shm").glob(f"kvstore-{node}-*")) - {live_arena}
        assert dead.proc is not None
        dead.proc.kill()
        os.waitid(os.P_PID, dead.proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: the pid exists
        os.kill(dead.proc.pid, 0)
        assert dead_arena.exists()
        server_factory(make_config(tmp_path / "new", ssd_bytes=None, node=node))
        assert (live_arena.exists(), dead_arena.exists()) == (True, False)
    finally:
        for proc in (live, dead):
            if proc.proc is not None:
                proc.proc.kill()
                proc.proc.wait(KILL_WAIT_S)
        for path in Path("/dev/shm").glob(f"kvstore-{node}-*"):  # what a failed run would leave
            path.unlink()


async def test_a_data_file_left_world_readable_by_an_older_version_is_made_private(server_factory, tmp_path) -> None:
    """Bug: the LMDB environments were made private also when an older version had created
    them 0644/0755, but the ssd data file (every stored page's KV bytes) kept the 0644 it
    had: a store upgraded in place stayed readable by every user of the host. (The
    directories given by --data-dir / --ssd-dir are the operator's, e.g. a mount point;
    what the server creates in them is private.)"""
    (tmp_path / "ssd").mkdir()
    (tmp_path / "ssd" / "pages.dat").touch()
    os.chmod(tmp_path / "ssd" / "pages.dat", 0o644)
    server_factory()
    modes = {**_modes(tmp_path / "data"), **_modes(tmp_path / "ssd")}
    loose = {name: mode for name, mode in modes.items()
             if name not in ("data", "ssd") and mode != ("700" if (tmp_path / name).is_dir() else "600")}
    assert loose == {}
