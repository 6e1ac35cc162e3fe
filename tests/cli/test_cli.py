"""kvstore-server flags and kvstore-ctl against a running server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from support.kv import random_kv

from kvstore.cli import ctl
from kvstore.cli import server as server_cli
from kvstore.client import KVStoreClient
from kvstore.config import ClusterConfig, HostTierConfig, parse_size
from kvstore.errors import ConfigError


@pytest.mark.parametrize("text, value", [("512MiB", 512 << 20), ("4GiB", 4 << 30), ("1.5GB", 1_500_000_000), ("4096", 4096), ("64 kib", 65536)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_parse_size_error_names_the_flag() -> None:
    with pytest.raises(ConfigError, match="--host-capacity"):
        parse_size("lots", "--host-capacity")


def _server(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli.server", *args], check=False, capture_output=True, text=True, timeout=60)


def test_hbm_without_cuda_exits_with_a_clear_message(tmp_path) -> None:
    res = _server("--tiers", "hbm,host,ssd", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0", "--metrics-listen", "off")
    assert res.returncode == 2
    assert "hbm" in res.stderr and ("CUDA" in res.stderr or "not implemented" in res.stderr)


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--tiers", "host,tape"], "unknown tier 'tape'"),
        (["--host-capacity", "lots"], "--host-capacity"),
        (["--host-capacity", "1MiB"], "--host-capacity must be at least"),
        (["--listen", "nowhere"], "--listen"),
        (["--max-streams", "4", "--max-subscribers", "8"], "--max-subscribers must be > 0 and at most --max-streams"),
        (["--stream-idle-s", "0"], "--stream-idle-s must be > 0"),
        (["--switch-interval-ms", "0"], "--switch-interval-ms must be > 0"),
        (["--demote-sched", "fifo"], "--demote-sched: invalid choice: 'fifo'"),
    ],
)
def test_bad_flags(tmp_path, args, expect) -> None:
    res = _server("--data-dir", str(tmp_path), "--metrics-listen", "off", *args)
    assert res.returncode == 2 and expect in res.stderr


def test_a_metrics_port_in_use_is_named_with_its_flag(tmp_path) -> None:
    """A second server on a host (the metrics port 9464 taken) says which address and which
    flag moves it, before it joins or serves anything; it used to say only 'Address already in use'."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        res = _server("--data-dir", str(tmp_path), "--listen", "127.0.0.1:0", "--metrics-listen", address)
    assert res.returncode == 2 and "ready" not in res.stdout
    assert f"--metrics-listen {address}: cannot bind" in res.stderr and "'off'" in res.stderr


@pytest.mark.parametrize("seconds", [-1.0, float("inf"), float("nan")])
def test_a_join_timeout_that_is_no_length_of_time_is_refused_naming_its_flag(seconds: float) -> None:
    with pytest.raises(ConfigError, match="--cluster-join-timeout-s must be >= 0"):
        ClusterConfig(etcd="etcd://127.0.0.1:1", node_id="n", advertise="127.0.0.1:1", join_timeout_s=seconds)


def test_a_demote_sched_outside_the_cli_is_refused_by_the_config_too() -> None:
    with pytest.raises(ConfigError, match="--demote-sched must be one of idle, normal, got 'fifo'"):
        HostTierConfig(capacity_bytes=64 << 20, demote_sched="fifo")


def test_the_server_sets_the_gil_switch_interval_it_was_given() -> None:
    """A lookup waits up to one switch interval for a thread holding the GIL (measured:
    lookup p99 ~5 ms under demotion with CPython's 5 ms); the server's default is
    shorter, and --switch-interval-ms sets it."""
    assert server_cli.build_parser().parse_args([]).switch_interval_ms < 5.0
    before = sys.getswitchinterval()
    try:
        server_cli.set_switch_interval(server_cli.build_parser().parse_args(["--switch-interval-ms", "0.25"]).switch_interval_ms)
        assert sys.getswitchinterval() == pytest.approx(0.00025)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("ms", ["inf", "nan", "1e-4"])
def test_a_switch_interval_python_would_turn_into_zero_is_refused(ms: str) -> None:
    """Bug: 'inf' and anything under CPython's 1 us resolution passed the '> 0' check and set
    an interval of 0 (sys.setswitchinterval(inf) leaves getswitchinterval() == 0.0): the
    opposite of what was asked, a GIL hand-off at every chance, silently."""
    before = sys.getswitchinterval()
    try:
        with pytest.raises(ConfigError, match="--switch-interval-ms"):
            server_cli.set_switch_interval(float(ms))
        assert sys.getswitchinterval() == before, f"--switch-interval-ms {ms} set {sys.getswitchinterval()} s"
    finally:
        sys.setswitchinterval(before)


async def test_ctl_stats_lookup_invalidate(server, layout, ns, capsys) -> None:
    tokens = list(range(100))
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, random_kv(layout, 100))
    nsargs = ["--model", "demo", "--revision", "r1", "--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--dtype", "float16"]
    base = ["--server", server.address, "--json"]

    assert ctl.main([*base, "stats"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 6 and stats["tiers"][0]["tier"] == "host" and stats["tiers"][0]["pages"] == 6

    assert ctl.main([*base, "lookup", *nsargs, "--tokens", ",".join(map(str, tokens))]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found == {"namespace_id": ns.namespace_id.hex(), "pages": 6, "tokens": 96, "full_pages_asked": 6, "by_tier": {"host": 6}}

    assert ctl.main([*base, "invalidate", "--namespace-id", ns.namespace_id.hex()]) == 0
    assert json.loads(capsys.readouterr().out) == {"namespace_id": ns.namespace_id.hex(), "removed": 6, "generation": 1}
    assert ctl.main([*base, "lookup", *nsargs, "--tokens", ",".join(map(str, tokens))]) == 0
    assert json.loads(capsys.readouterr().out)["pages"] == 0

    assert ctl.main(["--server", server.address, "stats"]) == 0
    assert "entries" in capsys.readouterr().out


def test_ctl_unreachable_server_is_a_clear_error(capsys) -> None:
    from kvstore.bench.common.harness import free_port

    assert ctl.main(["--server", f"127.0.0.1:{free_port()}", "--timeout", "1", "stats"]) == 1
    assert "kvstore-ctl:" in capsys.readouterr().err


def test_ctl_lookup_of_less_than_a_page_answers_none_stored(server, ns, capsys) -> None:
    """Bug: README's own example `kvstore-ctl lookup ... --tokens 1,2,3` exited 1 with
    'keys must not be empty': fewer tokens than one page make no page key, and the empty
    Lookup the CLI sent is refused by the server. Nothing of them can be stored: 0 pages."""
    nsargs = ["--model", "demo", "--revision", "r1", "--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--dtype", "float16"]
    assert ctl.main(["--server", server.address, "--json", "lookup", *nsargs, "--tokens", "1,2,3"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found == {"namespace_id": ns.namespace_id.hex(), "pages": 0, "tokens": 0, "full_pages_asked": 0, "by_tier": {}}
