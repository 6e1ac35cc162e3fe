"""Faults of a chaos history: drawn from its seed as slots of one or two faults at a time,
injected while the traffic runs; each fault heals itself at the end of its duration.

More: bench/chaos/README.md (### faults.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.bench.chaos.chaos_cluster import ChaosCluster
from kvstore.bench.chaos.history import Fault

logger = logging.getLogger(__name__)

DURATIONS_S = {
    "node_kill": (0.0, 1.5), "node_pause": (0.5, 3.0), "etcd_kill": (0.0, 1.5), "etcd_wipe": (0.0, 1.0),
    "etcd_link_cut": (1.0, 4.0), "etcd_link_delay": (0.5, 2.0), "data_link_slow": (0.3, 1.0), "arena_flip": (0.0, 0.0),
    "ssd_flip": (0.0, 0.0),
}
FLIPS = 64  # bytes an arena_flip changes; a 64 MiB arena a tenant fills to a few MiB: some land in stored pages
SSD_FLIPS = 8  # bytes an ssd_flip changes, each in a page its SSD tier indexes (a history's node holds tens)
SEEDED = ("arena_flip", "ssd_flip")  # kinds whose bytes land where their own seed says
KINDS = list(DURATIONS_S)
ETCD_KINDS = ("etcd_kill", "etcd_wipe")
TWO_AT_ONCE = 0.4  # the share of slots with two faults at a time
# kinds that hold a proxy in front of a node's data connections: none sits there with --data-plane ucx,
# as UCX connects to addresses it exchanges at wire-up (DESIGN §12.9)
DATA_LINK_KINDS = ("data_link_slow",)
DATA_PLANES = ("grpc", "tcp", "ucx")


def kinds_for(data_plane: str, named: Sequence[str] | None = None) -> list[str]:
    """The fault kinds a run on ``data_plane`` draws: ``named``, or by default every kind the
    plane can inject (with ucx all but ``DATA_LINK_KINDS``). ValueError, saying why, for a kind
    unknown or one the plane cannot inject."""
    allowed = [k for k in KINDS if data_plane != "ucx" or k not in DATA_LINK_KINDS]
    if named is None:
        return allowed
    unknown = sorted(set(named) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}; known: {','.join(KINDS)}")
    refused = [k for k in named if k not in allowed]
    if refused:
        raise ValueError(f"fault kinds {refused} need a proxy in front of the nodes' data connections, which "
                         f"--data-plane {data_plane} has none of (UCX connects to addresses it exchanges at wire-up); "
                         f"its kinds: {','.join(allowed)}")
    return list(named)


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    target: str  # a node's name, or "etcd"
    duration_s: float
    seed: int = 0  # arena_flip, ssd_flip: where its bytes land


def plan_faults(rng: random.Random, nodes: list[str], steady: str, kinds: list[str],
                num_slots: int) -> list[tuple[float, list[PlannedFault]]]:
    """``num_slots`` of (gap before, faults at once). Kinds come from a shuffled deck, so a
    history sees every kind before any repeats; two faults of a slot never share a target."""
    deck: list[str] = []
    slots = []
    for _ in range(num_slots):
        gap = rng.uniform(0.2, 1.0)
        chosen: list[PlannedFault] = []
        for _ in range(2 if rng.random() < TWO_AT_ONCE else 1):
            if not deck:
                deck = list(kinds)
                rng.shuffle(deck)
            kind = deck.pop()
            candidates = ["etcd"] if kind in ETCD_KINDS else [n for n in nodes if kind != "node_kill" or n != steady]
            free = [t for t in candidates if t not in {f.target for f in chosen}]
            if not free:
                deck.insert(0, kind)  # next slot's
                continue
            low, high = DURATIONS_S[kind]
            target, duration_s = rng.choice(free), round(rng.uniform(low, high), 3)
            chosen.append(PlannedFault(kind, target, duration_s, rng.getrandbits(32) if kind in SEEDED else 0))
        slots.append((gap, chosen))
    return slots


class Injector:
    """Runs a plan's slots until ``stop`` is set (the traffic ended), one slot at a time."""

    def __init__(self, cluster: ChaosCluster) -> None:
        self.cluster = cluster
        self.faults: list[Fault] = []

    async def run(self, slots: list[tuple[float, list[PlannedFault]]], stop: asyncio.Event) -> list[Fault]:
        for gap, planned in slots:
            try:
                await asyncio.wait_for(stop.wait(), gap)
            except TimeoutError:
                pass
            if stop.is_set():
                break
            self.faults += await asyncio.gather(*(self._inject(f) for f in planned))
        return self.faults

    async def _inject(self, planned: PlannedFault) -> Fault:
        fault = Fault(planned.kind, planned.target, planned.duration_s, start=time.monotonic())
        try:
            if planned.kind == "arena_flip":
                fault.detail = await asyncio.to_thread(self.cluster.node(planned.target).flip_arena_bytes,
                                                       random.Random(planned.seed), FLIPS)
            elif planned.kind == "ssd_flip":
                damage = await asyncio.to_thread(self.cluster.node(planned.target).flip_ssd_bytes,
                                                 random.Random(planned.seed), SSD_FLIPS)
                fault.detail, fault.keys = ("node down", []) if damage is None else (damage.describe(), damage.keys)
            else:
                await getattr(self, f"_{planned.kind}")(planned.target, planned.duration_s)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be healed is a finding, recorded
            logger.warning("fault %s on %s: %r", planned.kind, planned.target, exc)
            fault.error = f"{type(exc).__name__}: {exc}"
        fault.healed = time.monotonic()
        return fault

    async def _node_kill(self, target: str, down_s: float) -> None:
        node = self.cluster.node(target)
        await asyncio.to_thread(node.kill)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(node.start)

    async def _node_pause(self, target: str, duration_s: float) -> None:
        node = self.cluster.node(target)
        node.pause()
        try:
            await asyncio.sleep(duration_s)
        finally:
            node.resume()

    async def _etcd_kill(self, _target: str, down_s: float) -> None:
        await asyncio.to_thread(self.cluster.etcd.kill)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(self.cluster.etcd.start)

    async def _etcd_wipe(self, _target: str, down_s: float) -> None:
        await asyncio.to_thread(self.cluster.etcd.wipe)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(self.cluster.etcd.start)

    async def _etcd_link_cut(self, target: str, duration_s: float) -> None:
        link = self.cluster.node(target).etcd_link
        link.cut()
        try:
            await asyncio.sleep(duration_s)
        finally:
            link.restore()

    async def _etcd_link_delay(self, target: str, duration_s: float) -> None:
        link = self.cluster.node(target).etcd_link
        link.hold()
        try:
            await asyncio.sleep(duration_s)
        finally:
            link.release()

    async def _data_link_slow(self, target: str, duration_s: float) -> None:
        links = self.cluster.node(target).links
        for link in links:
            link.hold()
        try:
            await asyncio.sleep(duration_s)
        finally:
            for link in links:
                link.release()


async def heal_all(cluster: ChaosCluster) -> list[str]:
    """Every fault off: links flowing, nodes resumed, etcd and every node running. Returns
    what had to be (re)started: a process that died by itself, or a node a fault could not
    restart (its fault's error says why)."""
    died = []
    if not cluster.etcd.running:
        died.append("etcd exited by itself")
        await asyncio.to_thread(cluster.etcd.start)
    for node in cluster.nodes:
        node.etcd_link.heal()
        for link in node.links:
            link.heal()
        node.resume()
        if not node.running:
            assert node.proc is not None
            died.append(f"node {node.name} was down at the heal (status {node.proc.returncode}); see {node.log}")
            try:
                await asyncio.to_thread(node.start)
            except RuntimeError as exc:  # tried again at the next heal
                died.append(str(exc))
    return died
