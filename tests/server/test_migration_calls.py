"""Live migration's calls on one server (DESIGN §12.8): without a cluster they are clear errors
(INVALID_ARGUMENT) that change nothing; a session fenced here refuses its appends and the saves
naming it (FAILED_PRECONDITION, SessionFenced, counted) while other sessions go on; the owner
records survive a restart of the token log; random and undecodable payloads are clear errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from support.kv import random_kv

from kvstore._proto import data_pb2, directory_pb2, migration_pb2, migration_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.client.pages import slot_as_page
from kvstore.client.transport.contract import page_in
from kvstore.errors import InvalidRequest, SessionFenced, TierUnavailable
from kvstore.page import LayoutDesc, checksum
from kvstore.server.session_owners import FENCED, FREEZING, INCOMING, OWNED, Ownership, SessionOwners
from kvstore.server.tokenlog import MAX_SESSION_ID, TokenLog
from kvstore.validate import layout_msg


async def _move(client: KVStoreClient, method: str, request: object) -> object:
    async def call() -> object:
        return await client.runtime.rpc(getattr(migration_pb2_grpc.MigrationStub(client.runtime._channel), method), request)
    return await client.runtime.call(call())


async def test_without_a_cluster_the_calls_say_so_and_change_nothing(server, ns) -> None:
    async with KVStoreClient(server.address, ns) as client:
        await client.append_tokens("s", [1, 2, 3], expected_length=0, sync=True, prompt_tokens=2)
        with pytest.raises(InvalidRequest, match="cluster mode"):
            await client.migrate("s", "other", target_address=server.address)
        request = migration_pb2.FenceSessionRequest(namespace_id=client.namespace.namespace_id, session_id="s", to_node="x")
        with pytest.raises(InvalidRequest, match="cluster mode"):
            await _move(client, "Fence", request)
        with pytest.raises(InvalidRequest, match="another node"):
            await client.migrate("s", client.node)
        assert server.session_owners.items() == []
        assert await client.append_tokens("s", [4], expected_length=3, sync=True) == 4


async def test_a_fenced_session_refuses_appends_and_saves_naming_it_counted(server, ns, layout) -> None:
    async with KVStoreClient(server.address, ns) as client:
        await client.append_tokens("moved", [1, 2], expected_length=0, sync=True)
        await client.append_tokens("stays", [1, 2], expected_length=0, sync=True)
        server.session_owners.put(client.namespace.namespace_id, "moved", Ownership(1, FENCED, "n2"))
        with pytest.raises(SessionFenced, match="version 1 of the session is owned by node n2"):
            await client.append_tokens("moved", [3], expected_length=2, sync=True)
        allocate = data_pb2.AllocateRequest(namespace_id=client.namespace.namespace_id, layout=layout_msg(LayoutDesc.of(layout)),
                                            keys=[b"k" * 16], session_id="moved")
        with pytest.raises(SessionFenced):
            await client._call(client.runtime.data.Allocate, allocate)
        assert await client.append_tokens("stays", [3], expected_length=2, sync=True) == 3
        refusals = server.metrics.session_refusals
        assert refusals.labels("AppendTokens")._value.get() == 1 and refusals.labels("Allocate")._value.get() == 1
        logged = await client.read_session("moved")  # still readable here (a resumed migration reads it)
        assert logged is not None and logged.tokens == [1, 2]
        answer = await _move(client, "Status", migration_pb2.SessionStatusRequest(namespace_id=client.namespace.namespace_id,
                                                                                  session_id="moved"))
        assert (answer.state, answer.version, answer.owner) == ("fenced", 1, "n2")  # type: ignore[attr-defined]


def test_owner_records_are_durable_and_only_owned_accepts(tmp_path: Path) -> None:
    ns = b"n" * 16
    wal = TokenLog(tmp_path)
    refused: list[str] = []
    owners = SessionOwners(wal, "me", refused.append)
    for i, state in enumerate((OWNED, FREEZING, FENCED, INCOMING)):
        owners.put(ns, f"s{i}", Ownership(i, state, "me" if state == OWNED else "other"))
    owners.check(ns, "s0", "AppendTokens")
    owners.check(ns, "unknown", "AppendTokens")
    with pytest.raises(SessionFenced):  # fenced: for good
        owners.check(ns, "s2", "AppendTokens")
    for sid in ("s1", "s3"):  # a fence or an adoption etcd has not decided: retry
        with pytest.raises(TierUnavailable, match="retry"):
            owners.check(ns, sid, "AppendTokens")
    assert refused == ["AppendTokens"] * 3
    owners.drop(ns, "s3")
    wal.close()
    again = SessionOwners(TokenLog(tmp_path), "me", refused.append)
    assert sorted((sid, rec) for _, sid, rec in again.items()) == [
        ("s0", Ownership(0, OWNED, "me")), ("s1", Ownership(1, FREEZING, "other")), ("s2", Ownership(2, FENCED, "other"))]


async def test_undecodable_or_random_migration_requests_are_clear_errors(server, ns) -> None:
    """The Migration service gets random, truncated, mutated and valid payloads (as every other
    service does in test_bad_input.py): none answers INTERNAL or UNKNOWN or hangs, an undecodable
    one is INVALID_ARGUMENT naming the method; nothing is fenced and the server serves."""
    from test_bad_input import fuzz_failures

    _, failures = fuzz_failures(server.address, [migration_pb2], random.Random(37), 24)
    assert not failures, failures[:10]
    assert server.session_owners.items() == []
    async with KVStoreClient(server.address, ns) as client:
        assert await client.append_tokens("after", [1], expected_length=0, sync=True) == 1


async def _host_used(client: KVStoreClient) -> tuple[int, int]:
    """(host tier used bytes, leases) in the node's Stats."""
    stats = await client._call(client.runtime.directory.Stats, directory_pb2.StatsRequest())
    return next(t.used_bytes for t in stats.tiers if t.tier == "host"), int(stats.num_leases)


async def test_a_fenced_sessions_saves_are_refused_on_every_path_and_a_late_commit_leaves_nothing(server, ns, layout) -> None:
    """put / put_keys (Allocate), a stream put (WritePages), layer-wise saves on both paths, and the Commit
    of an allocation taken before the fence: SessionFenced, counted under each call, nothing stored or held."""
    tokens = list(range(4 * layout.page_tokens))
    kv = random_kv(layout, len(tokens), seed=37)
    half = 2 * layout.page_tokens
    async with KVStoreClient(server.address, ns) as client, KVStoreClient(server.address, ns, use_shm=False) as streamed:
        assert await client.put(tokens[:half], kv[:, :, :half], session_id="moved") == half
        before = await _host_used(client)
        keys = client.keys(tokens)
        late = client.transport.outgoing("moved")  # a layer-wise save reserved before the fence ...
        await client._io(late.reserve(keys[2:], keys[1]))
        for i, buffer in zip(late.indices, late.buffers):
            page_in(slot_as_page(buffer, layout), kv, 2 + i, layout)
        sums = [checksum(buffer.numpy()) for buffer in late.buffers]
        server.session_owners.put(client.namespace.namespace_id, "moved", Ownership(1, FENCED, "n2"))
        with pytest.raises(SessionFenced, match="owned by node n2"):  # ... and published after it
            await client._io(late.publish(sums, False))
        assert await _host_used(client) == before  # its slots freed, nothing pinned
        assert server.core.leases.counts().num_allocations == 0
        await client._io(late.discard())  # the client's own give-back: a no-op now
        for save in (client.put(tokens, kv, session_id="moved"), client.put_keys(keys, kv, session_id="moved")):
            with pytest.raises(SessionFenced):
                await save
        for save in (streamed.put(tokens, kv, session_id="moved"), streamed.put_keys(keys, kv, session_id="moved")):
            with pytest.raises(SessionFenced):  # refused at its first chunk, while the client still writes
                await save
        with pytest.raises(SessionFenced):
            await client.save(tokens, kv, start=half, session_id="moved").finished()
        with pytest.raises(SessionFenced):  # over WritePages: as above
            await streamed.save(tokens, kv, start=half, session_id="moved").finished()
        refusals = server.metrics.session_refusals
        assert {call: refusals.labels(call)._value.get() for call in ("Allocate", "WritePages", "Commit")} == \
            {"Allocate": 3, "WritePages": 3, "Commit": 1}
        assert await _host_used(client) == before and server.core.leases.counts().num_allocations == 0
        assert (await client.lookup(tokens)).num_tokens == half  # nothing of the session published after the fence
        assert await streamed.put(tokens, kv, session_id="stays") == len(tokens)  # another session's save goes on


async def test_a_bad_session_id_on_a_save_is_invalid_and_allocates_nothing(server, ns, layout) -> None:
    tokens = list(range(layout.page_tokens))
    kv = random_kv(layout, len(tokens), seed=38)
    async with KVStoreClient(server.address, ns) as client, KVStoreClient(server.address, ns, use_shm=False) as streamed:
        before = await _host_used(client)
        for saver in (client, streamed):
            for bad in ("x" * (MAX_SESSION_ID + 1), "a\x00b"):
                with pytest.raises(InvalidRequest, match="session_id"):
                    await saver.put(tokens, kv, session_id=bad)
        assert await _host_used(client) == before and server.core.leases.counts().num_allocations == 0
        assert server.session_owners.items() == []
