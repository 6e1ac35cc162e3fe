"""The lookup-balance simulation on the shipped 300-request Mooncake trace: its counts add
up, and a join moves about 1/(N+1) of the segments (DESIGN §12)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.bench.cluster.cluster_balance import load_chains, main, simulate
from kvstore.cluster.shards import ShardConfig, ShardMap, plan_lookup

TRACE = Path(__file__).parents[1] / "data" / "mooncake_trace_300.jsonl"


@pytest.mark.parametrize("nodes", [3, 16])
def test_simulation_counts_add_up(nodes: int) -> None:
    chains = load_chains(str(TRACE))
    row = simulate(chains, nodes, 1024)
    assert row["lookups"] == len(chains) == 300
    fanouts = [len(plan_lookup(c, ShardMap([f"node-{i}" for i in range(nodes)], ShardConfig(segment_pages=2))).requests())
               for c in chains]
    assert row["mean_rpcs"] == pytest.approx(sum(fanouts) / nodes, abs=0.1)
    assert 1.0 <= row["max_over_mean"] <= nodes
    assert 1 <= row["owners_median"] <= row["owners_p90"] <= row["owners_max"] <= nodes
    assert abs(row["join_moved"] - 1 / (nodes + 1)) < 0.5 / (nodes + 1)


def test_simulation_command_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--trace", str(TRACE), "--nodes", "3,16", "--segment-tokens", "1024", "--json"])
    out = capsys.readouterr().out
    assert "max/mean" in out and '"rows"' in out
