"""A data directory whose path is too long for a Unix socket gets its sockets' directory under
the temp directory (``arena_socket_path``). A SIGKILLed server cannot remove it; its restart on
the same data directory takes it over, so kills do not pile directories up under /tmp. A name
there that another user made, or made open to others, is never used (an attacker on the host
could otherwise own the directory the sockets are bound in)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.servers import ServerProcess, make_config

from kvstore.server import Server
from kvstore.server.socket_dir import MAX_SOCKET_PATH, arena_socket_path


def _deep(tmp_path: Path) -> Path:
    return tmp_path / ("d" * 60) / ("e" * 60)


@pytest.fixture(name="temp")
def temp_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The server's tempfile.gettempdir(): short, as /tmp is (under pytest-xdist a tmp_path is
    ~80 bytes, where a socket in a derived directory no longer fits and a random one is made)."""
    temp = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(temp))
    try:
        yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_a_killed_server_restarted_on_its_data_directory_leaves_one_sockets_directory(tmp_path: Path, temp: Path) -> None:
    server = ServerProcess(_deep(tmp_path))
    try:
        for _ in range(3):
            server.start()
            server.kill()
        server.start()
        made = list(temp.iterdir())
        assert len(made) == 1, f"each kill left its sockets' directory: {sorted(p.name for p in made)}"
        assert made[0].stat().st_mode & 0o777 == 0o700
        assert {p.name for p in made[0].iterdir()} >= {"call.sock"}
    finally:
        server.terminate()
        server.close_pipes()
    assert list(temp.iterdir()) == [], "a stopped server left its sockets' directory"


@pytest.mark.parametrize("squat", ["open to others", "a symlink"])
def test_a_squatted_sockets_directory_is_passed_over(tmp_path: Path, temp: Path, squat: str) -> None:
    data = _deep(tmp_path) / "data"
    data.mkdir(parents=True)
    digest = hashlib.sha256(os.fsencode(data.resolve())).hexdigest()[:16]
    squatted = temp / f"kvstore-{os.geteuid()}-{digest}"
    target = tmp_path / "attacker"
    target.mkdir(mode=0o777)
    os.chmod(target, 0o777)
    if squat == "a symlink":
        squatted.symlink_to(target)
    else:
        squatted.mkdir()
        os.chmod(squatted, 0o777)
    server = ServerProcess(_deep(tmp_path))
    try:
        server.start()
        assert list(target.iterdir()) == [], "the server bound its sockets in a directory it does not own alone"
        if squat != "a symlink":
            assert list(squatted.iterdir()) == []
        others = [p for p in temp.iterdir() if p != squatted]
        assert len(others) == 1 and others[0].stat().st_mode & 0o777 == 0o700
    finally:
        server.terminate()
        server.close_pipes()


def test_a_temp_directory_the_random_name_fitted_still_binds_the_sockets(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: the derived name (``kvstore-<uid>-<16 hex>``, 30-35 bytes) is 14-19 bytes longer than
    the random one it replaced (``kvstore-XXXXXXXX``), and its socket path was never measured: a
    temp directory of ~70-80 bytes, where a server started before, made the call socket's address
    too long to bind (the server refused to start: "use a shorter --data-dir"). A derived name whose
    sockets would not fit goes to a random directory, as before."""
    base = Path(tempfile.mkdtemp(prefix="kvl-", dir="/tmp"))  # short whatever pytest's base temp is
    temp = base / ("t" * (72 - len(os.fsencode(base)) - 1))  # the random name's sockets fit in 100 bytes
    temp.mkdir()
    assert len(os.fsencode(temp)) == 72
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    deep = _deep(tmp_path)
    try:
        server = Server(dataclasses.replace(make_config(deep, ssd_bytes=None), node="longtemp"))
        try:
            server.start()
            assert len(os.fsencode(server.call_socket.path)) <= MAX_SOCKET_PATH
        finally:
            server.stop(grace_s=0)
        assert list(temp.iterdir()) == [], "a stopped server left its sockets' directory"
        path = arena_socket_path(deep / "data", "arena.sock")  # the longest name; a random directory, made anew
        assert len(os.fsencode(path)) <= MAX_SOCKET_PATH and path.parent.parent == temp
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_squat_removed_between_the_mkdir_and_the_check_is_passed_over(tmp_path: Path, temp: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: another user's entry at the derived name made the mkdir fail (FileExistsError); its
    owner may remove it (the sticky temp directory lets it) before the lstat that checks it, which
    then raised FileNotFoundError out of the server's build: a local user looping create/remove on
    the name could stop a server from starting. The name is passed over for a new random one."""
    from kvstore.server import socket_dir

    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    real_mkdir = Path.mkdir

    def raced(self: Path, *args: object, **kwargs: object) -> None:
        if self.parent == temp and self.name.startswith(f"kvstore-{os.geteuid()}-"):
            raise FileExistsError(17, "File exists", str(self))  # the squat, removed right after
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket_dir.Path, "mkdir", raced)
    path = arena_socket_path(_deep(tmp_path) / "data", "call.sock")
    assert path.parent.parent == temp and path.parent.stat().st_mode & 0o777 == 0o700
    assert not path.parent.name.startswith(f"kvstore-{os.geteuid()}-")
