"""Live migration and idle expiry together (DESIGN §12.8, §9), under random steps, checked
against a simple model after every step: a session moves between two real nodes (or the move
is cut and resumed or aborted) while nodes are SIGKILLed, etcd is killed, and time passes with
no append, on nodes that end a session idle for IDLE_S. After each step exactly one node takes
the session's next append (the model's owner; the other refuses it as fenced once the session
moved, and has no log of it before), and the owner's
log is the model's, or the session ended: allowed only once no append was made for IDLE_S,
and required (waited for) after a step of nothing but time past it. After an end the session starts again at its
owner, and the old fence still holds at the other node. Seeded (seed 52 in the suite;
KVSTORE_MIGRATION_IDLE_SEEDS=51,53,... runs others; 51-61 passed). The seed is in the test id."""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest
from support.cluster_nodes import Node, cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from test_cluster_nodes import NS
from test_migration_model import settle

from kvstore.client import KVStoreClient
from kvstore.errors import InvalidRequest, KVStoreError, SessionFenced

SESSION = "idle-model"
IDLE_S = 3.0
SWEEP_S = IDLE_S / 4  # session_expiry.py: a sweep every quarter of the idle time


class Model:
    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.version = 0
        self.tokens: list[int] = []
        self.sent = 0.0  # when the last acknowledged append was sent (monotonic): the server logged it after


async def _append(node: Node, tokens: list[int], expected: int) -> str:
    """'ok', 'fenced', 'ended' (no log: idled out), or 'unsettled' (not reachable or not serving yet)."""
    try:
        async with KVStoreClient(node.address, NS, timeout_s=5.0) as client:
            await client.append_tokens(SESSION, tokens, expected_length=expected, sync=True)
    except SessionFenced:
        return "fenced"
    except InvalidRequest as exc:
        return "ended" if "idle past" in str(exc) else f"refused: {exc}"
    except (KVStoreError, OSError):
        return "unsettled"
    return "ok"


async def check(nodes: dict[str, Node], model: Model, token: int) -> str:
    """Exactly the model's owner takes the next append, the other refuses it as fenced; the owner's
    log is the model's. An owner without the log is checked against the idle time, then the
    session starts again there. Returns what the owner answered first."""
    other = next(name for name in nodes if name != model.owner)
    first: list[str] = []

    async def owner_settled() -> bool:
        sent = time.monotonic()
        seen = await _append(nodes[model.owner], [token], len(model.tokens))
        first.append(seen)
        if seen == "ended":
            idle = time.monotonic() - model.sent  # at most what the server saw
            assert idle > IDLE_S, f"the session ended {idle:.1f} s after its last append (idle time {IDLE_S} s)"
            model.tokens = []
            seen = await _append(nodes[model.owner], [token], 0)  # it starts again at its owner
        if seen == "ok":
            model.tokens.append(token)
            model.sent = sent
            return True
        assert seen == "unsettled", (seen, model.owner)
        return False

    try:
        await eventually(owner_settled, 40, "the owner answering for the session", every_s=0.2)
        answer: list[str] = []

        async def other_settled() -> bool:
            answer.append(await _append(nodes[other], [token + 1], len(model.tokens)))
            return answer[-1] != "unsettled"

        await eventually(other_settled, 40, "the other node answering for the session", every_s=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: the owner answered {first}, the model's owner {model.owner}") from None
    # a session never moved lives where it was started: the other node has no log of it, and no fence
    assert answer[-1] == ("fenced" if model.version else "ended"), (answer, model.owner, model.version)
    async with KVStoreClient(nodes[model.owner].address, NS) as client:
        logged = await client.read_session(SESSION)
    assert logged is not None and logged.tokens == model.tokens, (logged, model.tokens)
    return first[0]


async def _no_log(node: Node) -> bool:
    try:
        async with KVStoreClient(node.address, NS, timeout_s=5.0) as client:
            return await client.read_session(SESSION) is None
    except (KVStoreError, OSError):  # not answering now (a loaded host): asked again
        return False


@pytest.mark.parametrize("seed", [int(s) for s in os.environ.get("KVSTORE_MIGRATION_IDLE_SEEDS", "52").split(",")])
async def test_one_owner_and_no_early_end_under_random_migrations_and_idle_time(cluster_nodes, etcd, seed: int) -> None:
    rng = random.Random(seed)
    a, b = cluster_nodes(["a", "b"], "tcp", "--session-idle-s", str(IDLE_S))
    nodes = {"a": a, "b": b}
    model = Model("a")
    model.sent = time.monotonic()
    async with KVStoreClient(a.address, NS) as client:
        await client.append_tokens(SESSION, [1, 2, 3], expected_length=0, sync=True, prompt_tokens=3)
    model.tokens = [1, 2, 3]
    steps = []
    for step in range(10):
        op = rng.choice(["migrate", "migrate", "idle", "idle_then_migrate", "kill", "interrupted"])
        other = "b" if model.owner == "a" else "a"
        steps.append(op)
        print(f"step {step}: {op} (owner {model.owner}, {len(model.tokens)} tokens)", flush=True)
        if op.startswith("idle"):
            past = rng.random() < 0.6
            await asyncio.sleep(IDLE_S + SWEEP_S + 0.5 if past else IDLE_S / 3)  # past the idle time, or well within it
            if past and op == "idle":  # nothing but time since the last append: the session does end (no timing bet)
                await eventually(lambda: _no_log(nodes[model.owner]), 30, "the session idle past --session-idle-s ending")
        if op in ("migrate", "idle_then_migrate"):
            async with KVStoreClient(nodes[model.owner].address, NS) as client:
                try:
                    summary = await client.migrate(SESSION, other, max_pause_bytes=0)
                except InvalidRequest as exc:  # an ended session has nothing to move
                    assert time.monotonic() - model.sent > IDLE_S, exc
                    steps[-1] += "+nothing to move"
                else:
                    model.version += 1
                    assert summary.version == model.version
                    model.owner = other
        elif op == "kill":
            victim = nodes[rng.choice(["a", "b"])]
            victim.kill()
            victim.start()
        elif op == "interrupted":  # etcd gone between the last round and the fence, back; then resumed or aborted
            async with KVStoreClient(nodes[model.owner].address, NS) as client:
                with pytest.raises(KVStoreError):
                    await client.migrate(SESSION, other, max_pause_bytes=0, on_round=lambda *_: etcd.kill())
            etcd.start()
            resume = rng.random() < 0.5
            steps[-1] += "+resume" if resume else "+abort"

            await settle(nodes[model.owner], other, resume, SESSION)
            model.version += 1  # an abort decides the next version too, for the source
            if resume:
                model.owner = other
        steps[-1] += f" -> {await check(nodes, model, 100 + 2 * step)}"
    print(f"seed {seed}: {steps}; version {model.version}, owner {model.owner}")
