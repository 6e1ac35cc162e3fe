"""The chaos model on the UCX data plane (``kvstore-bench chaos --data-plane ucx``), short: one
history on three nodes moving pages over UCX (TCP on loopback) under a node's SIGKILL + restart
(on a new UCX address), a SIGSTOP and flipped arena bytes, checked as test_histories.py checks
its; and the fault kinds a ucx run draws: none that needs a proxy on the data link (DESIGN §12.9)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.bench.chaos import run as chaos_run
from kvstore.bench.chaos.chaos_cluster import ChaosCluster
from kvstore.bench.chaos.converge import durable_prefixes
from kvstore.bench.chaos.faults import DATA_LINK_KINDS, KINDS, kinds_for
from kvstore.bench.chaos.runner import Runner, Settings

# seed 3401's plan for these kinds: node_pause (n1, ~1.8 s) and arena_flip (n2) at ~0.7 s, node_kill
# (n3) at ~3.2 s, inside the 5 s of traffic; durable puts at n2, which no fault stops, are what (b)
# then reads at n1 and n3 through UCX
SEED, FAULTS = 3401, ["node_kill", "node_pause", "arena_flip"]
SETTINGS = Settings(num_ops=50, workers=4, traffic_s=5.0)
JOINED = re.compile(r"joined cluster .* data plane ucx on 127\.0\.0\.1:(\d+)\)")


@pytest.fixture(name="ucx_cluster")
def ucx_cluster_fixture(tmp_path: Path) -> Iterator[ChaosCluster]:
    cluster = ChaosCluster(tmp_path / "cluster", log_level="info", data_plane="ucx")  # info: the nodes' data plane line
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.mark.timeout(180)
async def test_a_history_on_the_ucx_plane_holds_the_model(ucx_cluster: ChaosCluster, tmp_path: Path) -> None:
    history = await Runner(ucx_cluster, SETTINGS).history(SEED, kinds=FAULTS, clean_up=False)
    if history.violations:
        path = history.write(tmp_path / f"history-{history.seed}.json")
        pytest.fail("\n".join(f"({v.check}) {v.what}; {path}; rerun: {history.reproduce}" for v in history.violations))
    assert sorted(f.kind for f in history.faults) == sorted(FAULTS)
    assert history.timings["convergence_s"] >= 0
    assert durable_prefixes(history), "no acknowledged durable put: (b) read nothing over UCX"
    assert history.reproduce.endswith("--data-plane ucx")
    killed = {f.target for f in history.faults if f.kind == "node_kill"}
    for node in ucx_cluster.nodes:  # every node served pages over UCX, a restarted one on a new listener
        ports = JOINED.findall(node.log.read_text())
        assert len(ports) == (2 if node.name in killed else 1), (node.name, ports)


def test_ucx_runs_every_fault_kind_but_the_data_links() -> None:
    assert kinds_for("grpc") == kinds_for("tcp") == KINDS
    assert kinds_for("ucx") == [k for k in KINDS if k not in DATA_LINK_KINDS] and "data_link_slow" in DATA_LINK_KINDS
    assert kinds_for("ucx", ["node_kill", "ssd_flip"]) == ["node_kill", "ssd_flip"]
    with pytest.raises(ValueError, match="unknown fault kinds"):
        kinds_for("tcp", ["node_kil"])
    parser = argparse.ArgumentParser()
    chaos_run.add_arguments(parser)
    with pytest.raises(SystemExit, match=r"--kinds: fault kinds \['data_link_slow'\] need a proxy .* --data-plane ucx"):
        chaos_run.run(parser.parse_args(["--data-plane", "ucx", "--kinds", "node_kill,data_link_slow"]))
    assert "data_link_slow" in parser.format_help()
