"""Live migration of a running session (DESIGN §12.8) on real nodes over a real etcd: a growing
session moves from a to b bit-exact while a keeps saving, and a's later writes are refused; the
target SIGKILLed mid-copy (no fence, a keeps the session, and the migration resumes once b is
back); the source SIGKILLed mid-copy (b takes over from the last round's copy; a restarted is
fenced before it serves); etcd killed before the fence (the source stays frozen, also across
its own restart) and restarted (the fence is made once), then wiped (the nodes write it back);
a source growing faster than the copy (cannot converge, nothing fenced). Growth is driven from
the migration's own round callback: no timing asserts."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch
from support.cluster_nodes import cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_nodes import LAYOUT, NS, ctl_cluster, tokens_of

from kvstore._proto import data_pb2, migration_pb2, migration_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.errors import CannotConverge, KVStoreError, SessionFenced, TierUnavailable
from kvstore.page import LayoutDesc
from kvstore.validate import layout_msg

PAGE = LAYOUT.page_tokens
PAGE_BYTES = LayoutDesc.of(LAYOUT).page_bytes


async def status(client: KVStoreClient, session_id: str) -> migration_pb2.SessionStatusResponse:
    async def call() -> migration_pb2.SessionStatusResponse:
        stub = migration_pb2_grpc.MigrationStub(client.runtime._channel)
        request = migration_pb2.SessionStatusRequest(namespace_id=client.namespace.namespace_id, session_id=session_id)
        return await client.runtime.rpc(stub.Status, request)
    return await client.runtime.call(call())


class Engine:
    """A generation at the source: its log and its saved pages grow by ``pages`` per call."""

    def __init__(self, client: KVStoreClient, session_id: str, tokens: list[int], kv: torch.Tensor, start_pages: int) -> None:
        self.client, self.tokens, self.kv = client, tokens, kv
        self.log = client.session(session_id)
        self.saved = start_pages * PAGE

    async def start(self) -> None:
        await self.log.start(self.tokens[: self.saved])
        assert await self.client.put(self.tokens[: self.saved], self.kv[:, :, : self.saved]) == self.saved

    async def grow(self, pages: int) -> None:
        end = min(len(self.tokens), self.saved + pages * PAGE)
        await self.log.returned(self.tokens[self.saved : end])
        await self.log.flush()
        assert await self.client.put(self.tokens[:end], self.kv[:, :, :end]) == end
        self.saved = end


async def test_a_growing_session_moves_bit_exact_and_the_source_is_fenced(cluster_nodes) -> None:
    a, b = cluster_nodes(["a", "b"], "tcp")
    tokens = tokens_of(370, 12)
    kv = random_kv(LAYOUT, len(tokens), seed=370)
    async with KVStoreClient(a.address, NS) as src, KVStoreClient(b.address, NS) as dst:
        engine = Engine(src, "s1", tokens, kv, 4)
        await engine.start()
        # the engine keeps generating during the pre-copy: two pages a round, for three rounds
        summary = await src.migrate("s1", "b", max_pause_bytes=0, stall_rounds=4,
                                    on_round=lambda *_: engine.grow(2) if engine.saved < len(tokens) else None)
        assert summary.version == 1 and summary.rounds >= 4 and summary.num_tokens == len(tokens)
        assert summary.round_bytes[0] == 4 * PAGE_BYTES and summary.total_bytes == 12 * PAGE_BYTES
        logged = await dst.read_session("s1")
        assert logged is not None and logged.tokens == tokens and logged.prompt_tokens == 4 * PAGE
        hit = await dst.lookup(tokens)
        assert hit.num_tokens == len(tokens) and {r.node for r in hit.runs} == {"b"}
        out = torch.zeros_like(kv)
        assert await dst.get(hit, out) == len(tokens)
        assert torch.equal(out, kv)
        # a's writes for the session are refused from the fence on: appends, and saves naming the session
        with pytest.raises(SessionFenced, match="fenced: version 1 .* node b"):
            await src.append_tokens("s1", [5], expected_length=len(tokens), sync=True)
        allocate = data_pb2.AllocateRequest(namespace_id=src.namespace.namespace_id, layout=layout_msg(LayoutDesc.of(LAYOUT)),
                                            keys=[b"k" * 16], session_id="s1")
        with pytest.raises(SessionFenced):
            await src._call(src.runtime.data.Allocate, allocate)
        assert await dst.append_tokens("s1", [7], expected_length=len(tokens), sync=True) == len(tokens) + 1
        # resumed after it finished: the same version, b's later tokens kept
        again = await src.migrate("s1", "b")
        assert again.version == 1
        logged = await dst.read_session("s1")
        assert logged is not None and logged.tokens == [*tokens, 7]
        there, here = await status(dst, "s1"), await status(src, "s1")
        assert (there.state, there.version, there.cluster_version, there.cluster_owner) == ("owned", 1, 1, "b")
        assert (here.state, here.owner) == ("fenced", "b")
        # and back to a with kvstore-ctl: version 2, a's writes accepted again, b's refused
        moved = _ctl_migrate(b.address, "s1", "a")
        assert moved["version"] == 2 and moved["num_tokens"] == len(tokens) + 1 and moved["rounds"] >= 1
        assert await src.append_tokens("s1", [8], expected_length=len(tokens) + 1, sync=True) == len(tokens) + 2
        with pytest.raises(SessionFenced, match="version 2 .* node a"):
            await dst.append_tokens("s1", [8], expected_length=len(tokens) + 1, sync=True)


def _ctl_migrate(server: str, session_id: str, to: str, *extra: str) -> dict:
    args = ["--server", server, "--json", "migrate", "--model", NS.model, "--revision", NS.revision, "--layers",
            str(LAYOUT.num_layers), "--kv-heads", str(LAYOUT.num_kv_heads), "--head-dim", str(LAYOUT.head_dim), "--dtype",
            "float16", "--page-tokens", str(PAGE), "--session", session_id, "--to", to, "--max-pause-ms", "50", *extra]
    done = subprocess.run([sys.executable, "-m", "kvstore.cli.ctl", *args], check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def test_the_target_killed_mid_copy_leaves_the_session_at_the_source_unfenced(cluster_nodes) -> None:
    a, b = cluster_nodes(["a", "b"], "tcp")
    tokens = tokens_of(371, 10)
    kv = random_kv(LAYOUT, len(tokens), seed=371)
    async with KVStoreClient(a.address, NS) as src:
        engine = Engine(src, "s2", tokens, kv, 4)
        await engine.start()

        async def kill_b(round_: int, *_: int) -> None:
            if round_ == 1:
                b.kill()
                await engine.grow(2)  # still something to copy: the next round meets a dead target

        with pytest.raises(KVStoreError):
            await src.migrate("s2", "b", max_pause_bytes=0, on_round=kill_b)
        here = await status(src, "s2")
        assert (here.state, here.version, here.cluster_version) == ("", 0, 0)  # no fence happened
        await engine.grow(2)  # the source keeps the session: its writes are accepted
        b.start()  # back on its data: the migration resumes
        summary = await src.migrate("s2", "b", max_pause_bytes=0)
        assert summary.version == 1
        async with KVStoreClient(b.address, NS) as dst:
            logged = await dst.read_session("s2")
            assert logged is not None and logged.tokens == tokens[: engine.saved]


async def test_the_source_killed_mid_copy_the_target_takes_over_and_the_source_returns_fenced(cluster_nodes, etcd) -> None:
    a, b = cluster_nodes(["a", "b"], "tcp")
    tokens = tokens_of(372, 10)
    kv = random_kv(LAYOUT, len(tokens), seed=372)
    async with KVStoreClient(a.address, NS) as src, KVStoreClient(b.address, NS) as dst:
        engine = Engine(src, "s3", tokens, kv, 6)
        await engine.start()

        async def kill_a(round_: int, *_: int) -> None:
            if round_ == 1:
                await engine.grow(1)  # logged and saved at a after the round: lost with a (the documented cost)
                a.kill()

        with pytest.raises(KVStoreError):
            await src.migrate("s3", "b", max_pause_bytes=0, on_round=kill_a)
        # b may not take over while a's lease lives (a may be serving): refused, then done once a is gone
        await eventually(_gone(etcd.url, "a"), 30, "a's lease expired")
        summary = _ctl_migrate(b.address, "s3", "b", "--force", "a")  # client.take_over at b
        assert summary["forced"] and summary["version"] == 1
        rec = await dst.recover("s3")  # the last fenced state: the log copy of round 1, its pages copied
        assert rec is not None and rec.tokens == tokens[: 6 * PAGE]
        assert rec.stored_tokens == 5 * PAGE and rec.to_prefill == tokens[5 * PAGE : 6 * PAGE - 1]
        assert await dst.append_tokens("s3", [9], expected_length=6 * PAGE, sync=True) == 6 * PAGE + 1
    a.start()  # back on its data (its log holds the page after round 1): fenced before it serves
    await eventually(lambda: _refused_at(a.address, "s3", 7 * PAGE), 20, "a reachable again, refusing s3's writes")


async def _refused_at(address: str, session_id: str, length: int, state: str = "fenced") -> bool:
    """Whether the node refuses the session's append as ``state`` says: fenced for good (SessionFenced), or
    "freezing", a fence not decided yet (TierUnavailable: retry). False: not reachable, or not serving, yet."""
    try:
        async with KVStoreClient(address, NS) as client:
            try:
                await client.append_tokens(session_id, [5], expected_length=length, sync=True)
            except (SessionFenced, TierUnavailable) as exc:
                if not isinstance(exc, SessionFenced if state == "fenced" else TierUnavailable) or (
                        state != "fenced" and "being fenced" not in str(exc)):
                    return False  # e.g. not caught up with the cluster yet
            else:
                raise AssertionError(f"node {address} took an append of session {session_id}")
            assert (await status(client, session_id)).state == state
    except (KVStoreError, OSError):
        return False
    return True


def _gone(etcd_url: str, node: str):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        return node not in {m["node"] for m in ctl_cluster(etcd_url)["members"]}
    return check


async def test_etcd_killed_before_the_fence_then_wiped_the_fence_is_made_once_and_kept(cluster_nodes, etcd) -> None:
    a, b = cluster_nodes(["a", "b"], "tcp")
    tokens = tokens_of(373, 6)
    kv = random_kv(LAYOUT, len(tokens), seed=373)
    async with KVStoreClient(a.address, NS) as src, KVStoreClient(b.address, NS) as dst:
        engine = Engine(src, "s4", tokens, kv, 6)
        await engine.start()
        with pytest.raises(KVStoreError):  # etcd gone between the last round and the fence
            await src.migrate("s4", "b", max_pause_bytes=0, on_round=lambda *_: etcd.kill())
        with pytest.raises(KVStoreError):  # frozen (or not serving): no write while the fence is undecided
            await src.append_tokens("s4", [5], expected_length=len(tokens), sync=True)
        a.kill()  # ... and across a restart: FREEZING is durable, nothing decided it
        etcd.start()  # the same etcd, back
        a.start()
        await eventually(lambda: _refused_at(a.address, "s4", len(tokens), "freezing"), 30, "a back, still frozen")
    async with KVStoreClient(a.address, NS) as src, KVStoreClient(b.address, NS) as dst:
        summary = await src.migrate("s4", "b", max_pause_bytes=0)
        assert summary.version == 1
        assert (await status(dst, "s4")).cluster_version == 1  # made once, not twice
        etcd.wipe()  # etcd replaced by an empty one: the nodes write the record back before they serve
        await eventually(lambda: _record_is(src, "s4", 1, "b"), 40, "the fence written back to etcd")
        await eventually(lambda: _refused_at(a.address, "s4", len(tokens)), 20, "a serving again, refusing s4's writes")


async def _status_ok(client: KVStoreClient, session_id: str) -> bool:
    try:
        await status(client, session_id)
    except KVStoreError:
        return False
    return True


async def _record_is(client: KVStoreClient, session_id: str, version: int, owner: str) -> bool:
    try:
        answer = await status(client, session_id)
    except KVStoreError:
        return False
    return (answer.cluster_version, answer.cluster_owner) == (version, owner)


async def test_a_source_growing_faster_than_the_copy_cannot_converge(cluster_nodes) -> None:
    a, b = cluster_nodes(["a", "b"], "tcp")
    tokens = tokens_of(374, 16)
    kv = random_kv(LAYOUT, len(tokens), seed=374)
    async with KVStoreClient(a.address, NS) as src, KVStoreClient(b.address, NS) as dst:
        engine = Engine(src, "s5", tokens, kv, 2)
        await engine.start()

        async def outgrow(round_: int, copied: int, left: int) -> None:
            await engine.grow(copied // PAGE_BYTES + 1)  # each round adds more than it copied

        with pytest.raises(CannotConverge, match="grows at least as fast"):
            await src.migrate("s5", "b", max_pause_bytes=0, stall_rounds=2, on_round=outgrow)
        here, there = await status(src, "s5"), await status(dst, "s5")
        assert (here.state, here.version, here.cluster_version) == ("", 0, 0)  # nothing fenced
        assert there.state == ""  # the target's copy of the log is gone
        await engine.grow(1)  # the source keeps the session
        assert (await src.read_session("s5")).tokens == tokens[: engine.saved]  # type: ignore[union-attr]


async def test_a_migration_resumed_long_after_its_fence_finds_the_log_and_then_lets_it_go(cluster_nodes) -> None:
    """Bug (review of the session expiry, R1): the migration's driver died after the fence;
    resumed more than --session-idle-s later, the source's log (after the fence, the only full
    copy: the target holds the last round's) had idled out and the session could never be adopted
    (the target INCOMING, the source fenced: nobody could write it). Now the source keeps a
    fenced session's log until etcd says the target adopted it, and only then lets it idle out."""
    a, b = cluster_nodes(["a", "b"], "tcp", "--session-idle-s", "1")
    tokens = tokens_of(372, 6)
    kv = random_kv(LAYOUT, len(tokens), seed=372)
    async with KVStoreClient(a.address, NS) as src:
        engine = Engine(src, "s6", tokens, kv, 4)
        await engine.start()

        moved = src._move

        async def dies_after_the_fence(runtime: object, method: str, request: object) -> object:
            answer = await moved(runtime, method, request)  # type: ignore[arg-type]
            if method == "Fence":
                raise RuntimeError("the migration's driver died after the fence")
            return answer

        src._move = dies_after_the_fence  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="driver died"):
            await src.migrate("s6", "b", max_pause_bytes=0)
        src._move = moved  # type: ignore[method-assign]
        here = await status(src, "s6")
        assert (here.state, here.cluster_owner) == ("fenced", "b")
        await asyncio.sleep(2.5)  # past the idle time (swept every 0.25 s)
        summary = await src.migrate("s6", "b", max_pause_bytes=0)  # resumed
        assert summary.version == here.version and summary.num_tokens == len(tokens[: engine.saved])
        async with KVStoreClient(b.address, NS) as dst:
            logged = await dst.read_session("s6")
            assert logged is not None and logged.tokens == tokens[: engine.saved]
        # adopted: the source's log is no longer the only copy and idles out (its fence record stays)
        await eventually(lambda: _no_log(src, "s6"), 10, "the source's log of an adopted session ending once idle")
        with pytest.raises(SessionFenced):
            await src.append_tokens("s6", [5], expected_length=0, sync=True)


async def _no_log(client: KVStoreClient, session_id: str) -> bool:
    return await client.read_session(session_id) is None
