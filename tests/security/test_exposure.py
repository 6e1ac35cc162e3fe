"""Protected mode: the server refuses to serve off loopback without TLS and authentication
(and /metrics off loopback at all) unless --insecure says so."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from support.certs import CertAuthority
from support.secure_server import grants, write_auth_file
from support.servers import ServerProcess, make_config

from kvstore.bench.common.harness import free_port
from kvstore.config import SecurityConfig
from kvstore.errors import ConfigError
from kvstore.security.exposure import is_local_address


@pytest.mark.parametrize(("address", "local"), [
    ("127.0.0.1:7070", True), ("127.8.9.10:1", True), ("[::1]:7070", True), ("localhost:7070", True),
    ("unix:/run/kv.sock", True), ("ipv4:127.0.0.1:7070", True), ("0.0.0.0:7070", False), ("[::]:7070", False),
    (":7070", False), ("10.0.0.5:7070", False), ("kv.example.com:7070", False), ("dns:///kv.example.com:7070", False),
])
def test_what_counts_as_loopback(address: str, local: bool) -> None:
    assert is_local_address(address) is local


def test_the_config_names_what_is_missing(tmp_path: Path) -> None:
    ca = CertAuthority(tmp_path / "ca")
    cert = ca.server_cert()
    auth = write_auth_file(tmp_path / "auth.json", grants())
    base = make_config(tmp_path)

    def config(listen: str = "0.0.0.0:0", metrics: str = "127.0.0.1:0", **security: object) -> None:
        replace(base, listen=listen, metrics_listen=metrics, security=SecurityConfig(**security))  # type: ignore[arg-type]

    with pytest.raises(ConfigError, match="no TLS.*--insecure"):
        config()
    with pytest.raises(ConfigError, match="no TLS"):
        config(auth_file=auth)  # tokens would cross the network in clear text
    with pytest.raises(ConfigError, match="no caller would be authenticated"):
        config(tls_cert=cert.cert, tls_key=cert.key)
    with pytest.raises(ConfigError, match="/metrics has no authentication"):
        config(listen="127.0.0.1:0", metrics="0.0.0.0:0")
    with pytest.raises(ConfigError, match="/metrics has no authentication"):
        config(metrics="[::]:9464", auth_file=auth, tls_cert=cert.cert, tls_key=cert.key)
    # What is allowed: protected off loopback, or anything with --insecure.
    config(auth_file=auth, tls_cert=cert.cert, tls_key=cert.key)
    config(tls_cert=cert.cert, tls_key=cert.key, tls_client_ca=ca.cert)
    config(metrics="0.0.0.0:0", insecure=True)


def test_tls_flags_are_checked(tmp_path: Path) -> None:
    ca = CertAuthority(tmp_path / "ca")
    cert, other = ca.server_cert(), ca.issue("other", server=True)
    with pytest.raises(ConfigError, match="go together"):
        SecurityConfig(tls_cert=cert.cert)
    with pytest.raises(ConfigError, match="--tls-client-ca needs"):
        SecurityConfig(tls_client_ca=ca.cert)
    with pytest.raises(ConfigError, match="--tls-key .*no such file"):
        SecurityConfig(tls_cert=cert.cert, tls_key=tmp_path / "missing.key")
    from kvstore.security.server_security import server_credentials

    with pytest.raises(ConfigError, match="private key"):
        server_credentials(SecurityConfig(tls_cert=cert.cert, tls_key=other.key))  # the key of another certificate
    with pytest.raises(ConfigError, match="--tls-client-ca"):
        server_credentials(SecurityConfig(tls_cert=cert.cert, tls_key=cert.key, tls_client_ca=cert.key))


def _run_server(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvstore.cli.server", "--data-dir", str(tmp / "data"), "--tiers", "host",
           "--host-capacity", "16MiB", "--log-level", "warning", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("flags", [["--listen", "0.0.0.0:{port}"], ["--listen", "127.0.0.1:{port}", "--metrics-listen", "0.0.0.0:0"]],
                         ids=["listen", "metrics-listen"])
def test_kvstore_server_refuses_a_non_loopback_address_without_insecure(tmp_path: Path, flags: list[str]) -> None:
    port = str(free_port())
    done = _run_server(tmp_path, *(f.format(port=port) for f in flags))
    assert done.returncode == 2
    assert "is not a loopback address" in done.stderr and "--insecure" in done.stderr
    assert not (tmp_path / "data").exists(), "refused before anything was created"


def test_kvstore_server_serves_a_non_loopback_address_with_insecure(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, "--insecure")
    server.args[server.args.index("--listen") + 1] = f"0.0.0.0:{server.port}"
    server.start()
    assert server.terminate() == 0
