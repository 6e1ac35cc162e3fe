"""Live migration's calls on one server (issue 37): without a cluster they are clear errors
(INVALID_ARGUMENT) that change nothing; a session fenced here refuses its appends and the saves
naming it (FAILED_PRECONDITION, SessionFenced, counted) while other sessions go on; the owner
records survive a restart of the token log; random and undecodable payloads are clear errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstore._proto import data_pb2, migration_pb2, migration_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.errors import InvalidRequest, SessionFenced
from kvstore.page import LayoutDesc
from kvstore.server.session_owners import FENCED, FREEZING, INCOMING, OWNED, Ownership, SessionOwners
from kvstore.server.tokenlog import TokenLog
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
    for sid in ("s1", "s2", "s3"):
        with pytest.raises(SessionFenced):
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
    import grpc
    from test_bad_input import _call, _payloads, _wrong

    rng = random.Random(37)
    failures = []
    with grpc.insecure_channel(server.address) as channel:
        for service in migration_pb2.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                for payload in _payloads(method, rng, 24):
                    code, details = _call(channel, service.full_name, method, [payload])
                    if _wrong(method, payload, code, details):
                        failures.append((method.name, code.name, details, payload[:40].hex()))
    assert not failures, failures[:10]
    assert server.session_owners.items() == []
    async with KVStoreClient(server.address, ns) as client:
        assert await client.append_tokens("after", [1], expected_length=0, sync=True) == 1
