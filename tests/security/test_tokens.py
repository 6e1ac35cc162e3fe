"""Bearer tokens on a real server over real TLS: every RPC refuses a caller without a valid
token, before its handler runs; a valid token stores and reads pages."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from support.certs import CertAuthority
from support.kv import random_kv
from support.secure_server import (
    ADMIN,
    ALICE,
    EXPIRED,
    call_raw,
    every_method,
    grants,
    secure_config,
    tls_channel,
    write_auth_file,
)

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import ClientTLS, KVStoreClient
from kvstore.errors import ConfigError, Unauthenticated
from kvstore.server import Server

METHODS = list(every_method())


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertAuthority:
    return CertAuthority(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, ca: CertAuthority) -> Iterator[Server]:
    """One server with TLS and an auth file for the module (starting one per test would
    dominate the run); the tests that change its state do not share it."""
    tmp = tmp_path_factory.mktemp("server")
    server = Server(secure_config(tmp, auth_file=write_auth_file(tmp / "auth.json", grants()), tls=ca.server_cert(),
                                  max_streams=2, max_subscribers=1))
    server.start()
    yield server
    server.stop(grace_s=1)


def test_the_protos_declare_rpcs() -> None:
    """Guards the enumeration below: if it found nothing, every per-RPC test would pass vacuously."""
    names = {m.name for _, m in METHODS}
    assert {"Lookup", "WritePages", "ReadPages", "Subscribe", "Quarantine", "GetSession"} <= names


@pytest.mark.parametrize(("service", "method"), METHODS, ids=[f"{s.name}.{m.name}" for s, m in METHODS])
@pytest.mark.parametrize("token", [None, "wrong-token-0123456789abcdef", EXPIRED], ids=["no-token", "wrong-token", "expired"])
def test_every_rpc_refuses_a_caller_without_a_valid_token(tls_server, ca, service, method, token) -> None:
    with tls_channel(tls_server.address, ca) as channel:
        assert call_raw(channel, service, method, token) == grpc.StatusCode.UNAUTHENTICATED


def test_refused_streams_take_no_stream_slot(tls_server, ca) -> None:
    """The server allows 2 streams (1 Subscribe): 10 refused Subscribe calls in a row must
    leave both free, since authentication runs before the stream gate."""
    subscribe = next((s, m) for s, m in METHODS if m.name == "Subscribe")
    with tls_channel(tls_server.address, ca) as channel:
        for _ in range(10):
            assert call_raw(channel, *subscribe, token="wrong-token-0123456789abcdef") == grpc.StatusCode.UNAUTHENTICATED
        stats = directory_pb2_grpc.DirectoryStub(channel).Stats(directory_pb2.StatsRequest(), timeout=10,
                                                                 metadata=[("authorization", f"Bearer {ADMIN}")])
        assert stats.node == "local"
        assert tls_server.streams.num_open == 0, "a refused stream holds a slot"
        events = directory_pb2_grpc.DirectoryStub(channel).Subscribe(
            directory_pb2.SubscribeRequest(), timeout=10, metadata=[("authorization", f"Bearer {ALICE}")])
        # the stream is admitted (a slot was free): the server holds it open. (Its initial metadata comes with
        # its first event, so waiting for that took the call's whole 10 s and proved nothing.)
        deadline = time.monotonic() + 10
        while tls_server.streams.num_open == 0 and events.is_active() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tls_server.streams.num_open == 1 and events.is_active(), "the stream was not admitted"
        events.cancel()


def test_refusals_say_why_and_are_counted(tls_server, ca) -> None:
    lookup = next((s, m) for s, m in METHODS if m.name == "Lookup")
    before = tls_server.metrics.rpc_errors.labels("Lookup", "UNAUTHENTICATED")._value.get()
    with tls_channel(tls_server.address, ca) as channel:
        stub = directory_pb2_grpc.DirectoryStub(channel)
        for token, said in ((None, "no credential"), ("wrong-token-0123456789abcdef", "unknown token"),
                            (EXPIRED, "expired"), ("", "Bearer <token>")):
            metadata = None if token is None else [("authorization", f"Bearer {token}".strip())]
            with pytest.raises(grpc.RpcError) as caught:
                stub.Lookup(directory_pb2.LookupRequest(), timeout=10, metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert said in caught.value.details()
        assert call_raw(channel, *lookup, token=None) == grpc.StatusCode.UNAUTHENTICATED
    assert tls_server.metrics.rpc_errors.labels("Lookup", "UNAUTHENTICATED")._value.get() == before + 5


async def test_a_valid_token_over_tls_stores_and_reads_pages(tls_server, ca, layout, ns) -> None:
    tokens = list(range(64))
    kv = random_kv(layout, len(tokens), seed=3)
    async with KVStoreClient(tls_server.address, ns, use_shm=False, token=ALICE, tls=ClientTLS(ca=ca.cert)) as client:
        assert await client.put(tokens, kv) == len(tokens)
        hit = await client.lookup(tokens)
        assert hit.num_tokens == len(tokens)
        out = torch.zeros_like(kv)
        assert await client.get(hit, into=out) == len(tokens)
        assert torch.equal(out, kv)


async def test_the_client_without_a_token_is_refused_with_unauthenticated(tls_server, ca, ns) -> None:
    with pytest.raises(Unauthenticated):
        async with KVStoreClient(tls_server.address, ns, tls=ClientTLS(ca=ca.cert), timeout_s=10):
            pass


def test_a_client_trusting_another_ca_is_refused(tls_server, tmp_path) -> None:
    other = CertAuthority(tmp_path / "other", "other CA")
    with tls_channel(tls_server.address, other) as channel:
        stub = directory_pb2_grpc.DirectoryStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Stats(directory_pb2.StatsRequest(), timeout=10, metadata=[("authorization", f"Bearer {ADMIN}")])
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in caught.value.details() or "handshake" in caught.value.details().lower()


def test_a_plain_text_client_gets_nothing_from_a_tls_server(tls_server) -> None:
    with grpc.insecure_channel(tls_server.address) as channel, pytest.raises(grpc.RpcError) as caught:
        directory_pb2_grpc.DirectoryStub(channel).Stats(directory_pb2.StatsRequest(), timeout=5,
                                                        metadata=[("authorization", f"Bearer {ADMIN}")])
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_token_without_tls_works_on_loopback(server_factory, tmp_path: Path, layout, ns) -> None:
    """Without TLS the token travels with gRPC's local credentials, which connect only to this host."""
    server = server_factory(secure_config(tmp_path, auth_file=write_auth_file(tmp_path / "auth.json", grants())))
    tokens = list(range(32))
    async with KVStoreClient(server.address, ns, use_shm=False, token=ALICE) as client:
        assert await client.put(tokens, random_kv(layout, len(tokens))) == len(tokens)
    with pytest.raises(Unauthenticated):
        async with KVStoreClient(server.address, ns, use_shm=False, token="wrong-token-0123456789abcdef", timeout_s=10):
            pass


def test_a_token_is_never_sent_in_clear_text_off_loopback(ns) -> None:
    """Refused when the channel is made, before anything is sent."""
    from kvstore.security.channel import sync_channel

    with pytest.raises(ConfigError, match="only over TLS"):
        sync_channel("10.1.2.3:7070", token=ALICE)
    with pytest.raises(ConfigError, match="printable ASCII"):
        sync_channel("127.0.0.1:7070", token="two words")
