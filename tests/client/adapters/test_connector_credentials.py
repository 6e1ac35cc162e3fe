"""The vLLM connector's token and TLS options, and its scheduler and worker sides on a real
kvstore-server with --auth-file (no engine: the real-engine proof is test_vllm_tenants.py)."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.servers import ServerProcess
from tenant_store import TOKEN_A, TOKEN_A2, TOKEN_B, TOKEN_UNKNOWN, num_leases, stop, tenant_server
from test_vllm_connector_parts import BLOCK, LAYOUT, NAMES, NUM_BLOCKS, forward, step

from kvstore import Namespace
from kvstore.bench.common.harness import free_port
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.connector_settings import ConnectorConfig
from kvstore.client.adapters.vllm.scheduler import SchedulerSide
from kvstore.client.adapters.vllm.worker import WorkerSide
from kvstore.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

NS = Namespace(model="tenants", revision="r", layout=LAYOUT)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = tenant_server(tmp_path)
    yield proc
    stop(proc)


def store(address: str, **extra: Any) -> StoreConnection:
    """A StoreConnection configured as the connector configures it from ``extra``."""
    config = ConnectorConfig.from_extra({"address": address, **extra}, environ={})
    return StoreConnection(address, NS, credentials=config.credentials, retry_s=0.2)


def sides(conn: StoreConnection) -> tuple[SchedulerSide, WorkerSide, dict[str, torch.Tensor]]:
    caches = {name: torch.zeros(NUM_BLOCKS, LAYOUT.num_kv_heads, BLOCK, 2 * LAYOUT.head_dim) for name in NAMES}
    worker = WorkerSide(conn, NAMES, BLOCK, NUM_BLOCKS, load_deadline_s=10, sync_load_pages=8)
    worker.register(caches)
    return SchedulerSide(conn, BLOCK, lookup_timeout_s=5), worker, caches


def save_prompt(conn: StoreConnection, tokens: list[int]) -> None:
    scheduler, worker, caches = sides(conn)
    forward(worker, step(scheduler, "writer", tokens, 0, list(range(4))), fill=1.0, caches=caches)
    deadline = time.monotonic() + 10
    while not worker.finished({"writer"}):
        assert time.monotonic() < deadline, "the save did not finish"
        time.sleep(0.01)


def wait_for(predicate: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_token_comes_from_its_option_its_file_or_the_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN_B + "\n")
    env_file = tmp_path / "env-token"
    env_file.write_text(TOKEN_A2)

    def credentials(environ: dict[str, str] | None = None, **extra: Any) -> Any:
        return ConnectorConfig.from_extra({"address": "127.0.0.1:1", **extra}, environ=environ or {}).credentials

    assert credentials(token=TOKEN_A).token == TOKEN_A
    assert credentials(token_file=str(token_file)).token == TOKEN_B
    assert credentials({"KVSTORE_TOKEN": TOKEN_A}).token == TOKEN_A
    assert credentials({"KVSTORE_TOKEN_FILE": str(env_file)}).token == TOKEN_A2
    assert credentials({"KVSTORE_TOKEN": TOKEN_A}, token_file=str(token_file)).token == TOKEN_B, "an option beats the environment"
    assert credentials().token is None and credentials().tls is None
    assert TOKEN_A not in repr(ConnectorConfig.from_extra({"address": "h:1", "token": TOKEN_A}, environ={}))
    tls = credentials(tls_ca=str(tmp_path / "ca.pem"), tls_server_name="kv").tls
    assert tls is not None and tls.ca == tmp_path / "ca.pem" and tls.server_name == "kv"
    with pytest.raises(ConfigError, match='kv_connector_extra_config "token" or kv_connector_extra_config "token_file", not both'):
        credentials(token=TOKEN_A, token_file=str(token_file))
    with pytest.raises(ConfigError, match='kv_connector_extra_config "token_file" .*missing: cannot read'):
        credentials(token_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"\$KVSTORE_TOKEN_FILE .*empty"):
        (tmp_path / "empty").write_text("\n")
        credentials({"KVSTORE_TOKEN_FILE": str(tmp_path / "empty")})
    with pytest.raises(ConfigError, match='kv_connector_extra_config "tls_key"'):
        credentials(tls_cert=str(tmp_path / "c.pem"))
    with pytest.raises(ConfigError, match="'token' must be a string"):
        credentials(token=123)


def test_a_lease_taken_in_the_salted_namespace_is_copied_and_given_back(server: ServerProcess) -> None:
    """Bug: the scheduler's LoadSpec carried the configured (unsalted) namespace id, the worker
    compared it with its client's salted one: on a server with tenants the lookup's lease was
    never copied from (every hit loaded again, layer by layer) nor given back (leaked until its TTL)."""
    writer, reader = store(server.address, token=TOKEN_A), store(server.address, token=TOKEN_A2)
    try:
        assert writer.start() and reader.start()
        tokens = list(range(1, 4 * BLOCK + 2))
        save_prompt(writer, tokens)
        scheduler, worker, _ = sides(reader)
        meta = step(scheduler, "reader", tokens, 0, list(range(8, 13)))
        [load] = meta.loads
        client = reader.client()
        assert client is not None and client.namespace.tenant_salt, "a tenant's client folds in its salt"
        assert load.lease is not None and load.num_pages == 4
        forward(worker, meta)
        assert wait_for(lambda: num_leases(server.address) == 0), f"{num_leases(server.address)} leases left"
        assert worker.stats.leased_copies == 1 and worker.stats.loaded_tokens == 4 * BLOCK
        assert load.namespace_id == client.namespace.namespace_id != NS.namespace_id
    finally:
        writer.close()
        reader.close()


def test_a_refused_token_fails_the_start_naming_the_option(server: ServerProcess, caplog: pytest.LogCaptureFixture) -> None:
    for extra, message in [({"token": TOKEN_UNKNOWN}, 'unknown token.*check the token of kv_connector_extra_config "token"'),
                           ({}, 'no credential.*give a token with kv_connector_extra_config "token" or')]:
        conn = store(server.address, **extra)
        try:
            with caplog.at_level(logging.ERROR), pytest.raises(ConfigError, match=message):
                conn.start()
            assert conn.num_refused == 1 and conn.client() is None
            assert any("refuses this client" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
        finally:
            conn.close()


def test_an_unreachable_server_is_a_counted_miss_not_an_error() -> None:
    conn = store(f"127.0.0.1:{free_port()}", token=TOKEN_A)
    try:
        assert conn.start() is False
        assert conn.num_unreachable == 1 and conn.num_refused == 0
        scheduler = SchedulerSide(conn, BLOCK, lookup_timeout_s=0.2)
        assert step(scheduler, "r", list(range(1, 3 * BLOCK)), 0, [0, 1, 2]).loads == []
    finally:
        conn.close()


def test_a_token_revoked_while_the_engine_runs_is_logged_as_refused(server: ServerProcess, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    conn = store(server.address, token=TOKEN_A2)
    try:
        assert conn.start()
        scheduler, _, _ = sides(conn)
        auth = tmp_path / "auth.json"
        auth.write_text(auth.read_text().replace(TOKEN_A2, TOKEN_UNKNOWN))  # revoke TOKEN_A2 (and grant another)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGHUP)
        with caplog.at_level(logging.ERROR):
            assert wait_for(lambda: step(scheduler, f"r{time.monotonic()}", list(range(1, 3 * BLOCK)), 0, [0, 1, 2]).loads == []
                            and conn.refused is not None, timeout_s=10), "the revoked token was not reported"
        assert "unknown token" in str(conn.refused) and conn.num_refused >= 1
        assert any("refuses this client" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    finally:
        conn.close()


def test_the_tls_options_reach_a_server_with_tls_and_tokens(tmp_path: Path) -> None:
    from support.certs import CertAuthority

    ca = CertAuthority(tmp_path / "ca")
    cert = ca.server_cert()
    server = tenant_server(tmp_path, "--tls-cert", str(cert.cert), "--tls-key", str(cert.key))
    writer = store(server.address, token=TOKEN_A, tls_ca=str(ca.cert))
    reader = store(server.address, token=TOKEN_B, tls_ca=str(ca.cert), tls_server_name="localhost")
    try:
        assert writer.start() and reader.start()
        tokens = list(range(1, 4 * BLOCK + 2))
        save_prompt(writer, tokens)
        client = writer.client()
        assert client is not None and writer.num_stored(client, client.keys(tokens), 5.0) == 4
        other = reader.client()
        assert other is not None and reader.num_stored(other, other.keys(tokens), 5.0) == 0, "b sees a's pages"
    finally:
        writer.close()
        reader.close()
        stop(server)
