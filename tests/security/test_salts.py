"""Tenant salts: random, one per tenant, private on disk, the same after a restart, and a
damaged file stops the server instead of silently re-keying every tenant."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from support.secure_server import grants, write_auth_file
from support.servers import ServerProcess

from kvstore.errors import ConfigError
from kvstore.security.salts import FILE_NAME, SALT_BYTES, TenantSalts


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_salts_are_random_per_tenant_private_and_kept(tmp_path: Path) -> None:
    data = tmp_path / "data"
    salts = TenantSalts(data)
    alice, bob = salts.salt("alice"), salts.salt("bob")
    assert len(alice) == len(bob) == SALT_BYTES and alice != bob
    assert salts.salt("alice") == alice, "assigned once"
    assert (_mode(data), _mode(data / FILE_NAME)) == (0o700, 0o600)
    assert sorted(p.name for p in data.iterdir()) == [FILE_NAME], "no temporary file left behind"
    again = TenantSalts(data)
    assert (again.salt("alice"), again.salt("bob")) == (alice, bob)
    other = TenantSalts(tmp_path / "other")
    assert other.salt("alice") != alice, "not derived from the tenant's name"


def test_a_loose_salt_file_is_made_private_again(tmp_path: Path) -> None:
    salts = TenantSalts(tmp_path)
    salts.salt("alice")
    os.chmod(tmp_path / FILE_NAME, 0o644)
    TenantSalts(tmp_path)
    assert _mode(tmp_path / FILE_NAME) == 0o600


@pytest.mark.parametrize("content", [b"{", b'{"salts": {"alice": "zz"}}', b'{"salts": {"alice": "00"}}', b"[]"],
                         ids=["truncated", "not-hex", "short", "wrong-shape"])
def test_a_damaged_salt_file_is_refused_not_replaced(tmp_path: Path, content: bytes) -> None:
    (tmp_path / FILE_NAME).write_bytes(content)
    with pytest.raises(ConfigError, match="damaged"):
        TenantSalts(tmp_path)
    assert (tmp_path / FILE_NAME).read_bytes() == content


def test_kvstore_server_assigns_salts_at_start_and_keeps_them_across_restarts(tmp_path: Path) -> None:
    auth = write_auth_file(tmp_path / "auth.json", grants())
    server = ServerProcess(tmp_path, "--auth-file", str(auth))
    server.start()
    assert server.terminate() == 0
    path = tmp_path / "data" / FILE_NAME
    first = json.loads(path.read_text())["salts"]
    assert set(first) == {"alice", "bob", "ops"} and _mode(path) == 0o600 and _mode(path.parent) == 0o700
    server.start()
    assert server.terminate() == 0
    assert json.loads(path.read_text())["salts"] == first


def test_kvstore_server_without_an_auth_file_writes_no_salts(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path)
    server.start()
    assert server.terminate() == 0
    assert not (tmp_path / "data" / FILE_NAME).exists()


def test_kvstore_server_refuses_to_start_on_a_damaged_salt_file(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir(mode=0o700)
    (tmp_path / "data" / FILE_NAME).write_text("{")
    server = ServerProcess(tmp_path, "--auth-file", str(write_auth_file(tmp_path / "auth.json", grants())))
    with pytest.raises(RuntimeError, match="damaged"):
        server.start()
    assert server.proc is not None
    assert not list(Path("/dev/shm").glob(f"kvstore-*-{server.proc.pid}-*")), "refused before an arena was made"
