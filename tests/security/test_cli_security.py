"""kvstore-ctl and kvstore-bench with --token/--token-file and the TLS options, against a
real server with TLS and an auth file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.certs import CertAuthority
from support.secure_server import ADMIN, grants, secure_config, write_auth_file

from kvstore.bench import main as bench_main
from kvstore.cli import ctl


def test_kvstore_ctl_with_a_token_over_tls(server_factory, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ca = CertAuthority(tmp_path / "ca")
    server = server_factory(secure_config(tmp_path, auth_file=write_auth_file(tmp_path / "auth.json", grants()),
                                          tls=ca.server_cert()))
    token_file = tmp_path / "token"
    token_file.write_text(ADMIN + "\n")
    base = ["--server", server.address, "--tls-ca", str(ca.cert), "--json"]
    assert ctl.main([*base, "--token-file", str(token_file), "stats"]) == 0
    assert json.loads(capsys.readouterr().out)["node"] == "local"
    monkeypatch.setenv("KVSTORE_TOKEN", ADMIN)
    assert ctl.main([*base, "quarantine"]) == 0
    assert json.loads(capsys.readouterr().out)["quarantined"] == 0
    monkeypatch.delenv("KVSTORE_TOKEN")
    assert ctl.main([*base, "stats"]) == 1
    assert "no credential" in capsys.readouterr().err
    assert ctl.main([*base, "--token", "wrong-token-0123456789abcdef", "stats"]) == 1
    assert "unknown token" in capsys.readouterr().err
    assert ctl.main(["--server", server.address, "--json", "--token", ADMIN, "stats"]) == 1, "plain text to a TLS port"
    assert ctl.main([*base, "--token", ADMIN, "--token-file", str(token_file), "stats"]) == 1
    assert "not both" in capsys.readouterr().err


def test_kvstore_bench_checks_the_security_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bench_main.main(["--tls-cert", str(tmp_path / "c.pem"), "throughput"])
    assert exited.value.code == 2
    assert "go together" in capsys.readouterr().err
