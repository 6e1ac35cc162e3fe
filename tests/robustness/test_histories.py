"""The model-checked robustness suite, short (DESIGN §12.4): random concurrent traffic of two
tenants on three real nodes and a real etcd under random faults, each history checked
against the model of kvstore.bench.chaos (model.py, chaos_validate.py, converge.py). Every fault
kind runs; the long run is ``kvstore-bench chaos``. The nodes move pages over the TCP data plane,
where a direct handoff's layers go ahead of its commit (DESIGN §12.7; ``kvstore-bench chaos``
runs the gRPC one by default). On failure the message names each failing seed, what it
violated, the JSON history written and the command to rerun it."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.ssd_pages import store_page

from kvstore.bench.chaos.chaos_cluster import ChaosCluster
from kvstore.bench.chaos.faults import KINDS, PlannedFault, plan_faults
from kvstore.bench.chaos.history import History
from kvstore.bench.chaos.runner import Runner, Settings, resource_violations
from kvstore.bench.chaos.ssd_flip import flip_ssd
from kvstore.bench.chaos.traffic import Planned, plan_traffic
from kvstore.config import SsdTierConfig
from kvstore.page import LayoutDesc
from kvstore.tiers.ssd import SsdTier

SETTINGS = Settings(num_ops=70, workers=4, traffic_s=7.0)
# (seed, fault kinds): three histories that between them inject every kind. Each seed's plan
# has two faults in its first slot and its other kinds in its second, which starts within
# ~6.5 s (gaps <= 1 s, a fault <= 4.5 s with a node's restart): inside the 7 s of traffic
HISTORIES = [
    (3401, ["node_kill", "etcd_link_cut", "data_link_slow"]),
    (3404, ["etcd_wipe", "node_pause", "etcd_link_delay", "arena_flip"]),
    # ssd_flip hits n3's durable pages at ~0.8 s, a node_kill of n3 follows at ~3 s (the plan has
    # another pair at ~7 s, inside the traffic when it runs late): n3 recovers its index from the
    # damaged SSD data and serves from it, also to the checks after the heal
    (8889, ["etcd_kill", "node_kill", "etcd_link_cut", "ssd_flip"]),
]


def fault_plan(seed: int, kinds: list[str]) -> list[tuple[float, list[PlannedFault]]]:
    """The fault slots ``Runner.history`` draws for ``seed``."""
    rng = random.Random(seed)
    rng.getrandbits(64)  # the ops' stream
    return plan_faults(random.Random(rng.getrandbits(64)), ["n1", "n2", "n3"], "n1", kinds, 8)


@pytest.fixture(name="chaos_cluster")
def chaos_cluster_fixture(tmp_path: Path) -> Iterator[ChaosCluster]:
    cluster = ChaosCluster(tmp_path / "cluster", data_plane="tcp")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.mark.timeout(300)
async def test_random_histories_under_faults_hold_the_model(chaos_cluster: ChaosCluster, tmp_path: Path) -> None:
    runner = Runner(chaos_cluster, SETTINGS)
    histories: list[History] = []
    for i, (seed, kinds) in enumerate(HISTORIES):
        # the last history's clean-up (its namespaces invalidated at every node, ~3 s) would be
        # checked by no later history's heal: the cluster closes after it
        histories.append(await runner.history(seed, kinds=kinds, clean_up=i < len(HISTORIES) - 1))
    failures = []
    for history in histories:
        if history.violations:
            path = history.write(tmp_path / f"history-{history.seed}.json")
            failures += [f"seed {history.seed} ({v.check}): {v.what}; {path}; rerun: {history.reproduce}" for v in history.violations]
    failures += [v["what"] for v in resource_violations([h.resources for h in histories])]
    assert not failures, "\n".join(failures)
    assert {f.kind for h in histories for f in h.faults} == set(KINDS)
    assert all(h.timings["convergence_s"] >= 0 for h in histories)


def test_a_seed_reproduces_a_history_plan() -> None:
    """The schedule is the seed's: the same seed plans the same ops and faults, and half the
    ops at half the traffic time is the first half of the plan (what shrinking relies on)."""

    def plan(seed: int, num_ops: int, traffic_s: float) -> tuple[list[list[int]], list[Planned], object]:
        rng = random.Random(seed)
        roots, ops = plan_traffic(random.Random(rng.getrandbits(64)), num_ops, 4, ["n1", "n2", "n3"], ["a", "b"], ["x", "y"],
                                  traffic_s)
        return roots, ops, fault_plan(seed, KINDS)

    roots, ops, faults = plan(7, 64, 6.0)
    assert plan(7, 64, 6.0) == (roots, ops, faults)
    assert plan(8, 64, 6.0) != (roots, ops, faults)
    short_roots, short_ops, short_faults = plan(7, 32, 3.0)
    assert short_roots == roots and short_faults == faults
    assert [dataclasses.replace(p, at_s=0) for p in short_ops] == [dataclasses.replace(p, at_s=0) for p in ops[:32]]
    assert max(abs(a.at_s - b.at_s) for a, b in zip(short_ops, ops, strict=False)) < 0.06  # the same pace (+ jitter)
    for seed, kinds in HISTORIES:  # what the suite's coverage of every kind relies on
        slots = fault_plan(seed, kinds)
        assert len(slots[0][1]) == 2 and {f.kind for _, slot in slots[:2] for f in slot} == set(kinds)
    assert all(f.target != "n1" for _, slot in fault_plan(9, KINDS) for f in slot if f.kind == "node_kill")  # the steady node


def test_an_ssd_flip_damages_exactly_the_pages_it_names(tmp_path: Path) -> None:
    """What the model lets (b) lose after an ssd_flip is the pages the fault names: after a
    restart of the tier on the flipped data every one of them fails its read (payload, slot
    header or index entry), and every other page reads back whole."""
    layout, config = LayoutDesc(2, 2, 2, 64, "float16", 16), SsdTierConfig(tmp_path, capacity_bytes=32 << 20, dwpd=0)
    rng = random.Random(0)
    payloads = {i.to_bytes(16, "big"): rng.randbytes(layout.page_bytes) for i in range(24)}
    places: dict[str, int] = {}
    for seed in range(4):
        tier = SsdTier(config)
        for key, payload in payloads.items():
            store_page(tier, key, layout, payload)
        tier.close()
        damage = flip_ssd(tmp_path, random.Random(seed), 8)
        places = {p: places.get(p, 0) + n for p, n in damage.places.items()}
        tier = SsdTier(config)
        for key, payload in payloads.items():
            into = bytearray(len(payload))
            whole = tier.read_into([(key, memoryview(into))]).num_read == 1
            assert whole != (key.hex() in damage.keys) and (not whole or into == payload), (seed, key.hex())
        tier.delete(list(payloads))
        tier.close()
    assert all(places.values()), places  # payloads, slot headers and index entries were hit
