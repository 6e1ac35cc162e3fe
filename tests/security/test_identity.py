"""The identity handlers see: the real interceptor in a real gRPC server (TLS and mTLS with
certificates made here), in front of a small service that answers who called it."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.certs import CertAuthority, Issued
from support.kv import random_kv
from support.secure_server import ADMIN, ALICE, BOB, grants, secure_config, tls_channel, write_auth_file

from kvstore.client import ClientTLS, KVStoreClient
from kvstore.config import SecurityConfig
from kvstore.errors import Unauthenticated
from kvstore.security.interceptor import current_identity
from kvstore.security.salts import TenantSalts
from kvstore.security.server_security import ServerSecurity


def _who() -> bytes:
    identity = current_identity()
    return json.dumps({"tenant": identity.tenant, "rights": identity.rights.names(), "salt": identity.salt.hex(),
                       "via": identity.via}).encode()


def _elsewhere() -> bytes:
    """The identity as a thread the handler hands work to sees it: not at all."""
    with ThreadPoolExecutor(1) as pool:
        try:
            return pool.submit(current_identity).result().tenant.encode()
        except Unauthenticated:
            return b"unauthenticated"


def _chat(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    """One answer per request; Unauthenticated (a caller revoked mid-stream) is answered as
    the kvstore services answer it."""
    try:
        for _ in requests:
            yield _who()
    except Unauthenticated as exc:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))


class WhoAmI(grpc.GenericRpcHandler):
    """/t.Who/Unary, /Stream (3 answers), /Upload (counts requests), /Chat (echoes per request), /Elsewhere."""

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        name = details.method.rsplit("/", 1)[-1]
        handlers: dict[str, Callable[[], grpc.RpcMethodHandler]] = {
            "Unary": lambda: grpc.unary_unary_rpc_method_handler(lambda _req, _ctx: _who()),
            "Elsewhere": lambda: grpc.unary_unary_rpc_method_handler(lambda _req, _ctx: _elsewhere()),
            "Stream": lambda: grpc.unary_stream_rpc_method_handler(lambda _req, _ctx: (_who() for _ in range(3))),
            "Upload": lambda: grpc.stream_unary_rpc_method_handler(
                lambda reqs, _ctx: json.dumps([json.loads(_who()) for _ in reqs]).encode()),
            "Chat": lambda: grpc.stream_stream_rpc_method_handler(_chat),
        }
        return handlers[name]() if name in handlers else None


class WhoServer:
    def __init__(self, tmp: Path, security: SecurityConfig) -> None:
        self.security = ServerSecurity(security, tmp / "data")
        self.grpc = grpc.server(futures.ThreadPoolExecutor(8), handlers=[WhoAmI()], interceptors=[self.security.interceptor])
        self.port = self.security.add_port(self.grpc, "127.0.0.1:0")
        assert self.port
        self.grpc.start()
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.grpc.stop(0).wait()


@pytest.fixture
def ca(tmp_path: Path) -> CertAuthority:
    return CertAuthority(tmp_path / "ca")


@pytest.fixture
def who_factory(tmp_path: Path) -> Iterator[Callable[..., WhoServer]]:
    started: list[WhoServer] = []

    def start(**security: Any) -> WhoServer:
        server = WhoServer(tmp_path, SecurityConfig(**security))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _ask(channel: grpc.Channel, method: str = "Unary", token: str | None = None) -> dict[str, Any]:
    return json.loads(channel.unary_unary(f"/t.Who/{method}")(b"", timeout=10, metadata=_bearer(token) if token else None))


def test_handlers_see_the_token_holders_tenant_rights_and_salt(who_factory, tmp_path) -> None:
    server = who_factory(auth_file=write_auth_file(tmp_path / "auth.json", grants()))
    salts = TenantSalts(tmp_path / "data")
    with grpc.insecure_channel(server.address) as channel:
        alice, bob, ops = (_ask(channel, token=t) for t in (ALICE, BOB, ADMIN))
    assert (alice["tenant"], alice["rights"], alice["via"]) == ("alice", ["read", "write"], "token")
    assert (ops["tenant"], ops["rights"]) == ("ops", ["read", "write", "admin"])
    assert alice["salt"] == salts.salt("alice").hex() and bob["salt"] == salts.salt("bob").hex()
    assert len({alice["salt"], bob["salt"], ops["salt"]}) == 3


def test_every_kind_of_call_sees_its_own_caller_under_concurrency(who_factory, tmp_path) -> None:
    """32 concurrent calls of each kind, alice and bob interleaved on 8 server threads: each
    answer (and each message of a stream) names the caller of that call, never the other."""
    server = who_factory(auth_file=write_auth_file(tmp_path / "auth.json", grants()))
    with grpc.insecure_channel(server.address) as channel:

        def one(i: int) -> set[str]:
            token, md = (ALICE, _bearer(ALICE)) if i % 2 else (BOB, _bearer(BOB))
            seen = {_ask(channel, token=token)["tenant"]}
            seen |= {json.loads(r)["tenant"] for r in channel.unary_stream("/t.Who/Stream")(b"", timeout=10, metadata=md)}
            upload = channel.stream_unary("/t.Who/Upload")(iter([b""] * 3), timeout=10, metadata=md)
            seen |= {answer["tenant"] for answer in json.loads(upload)}
            seen |= {json.loads(r)["tenant"] for r in channel.stream_stream("/t.Who/Chat")(iter([b""] * 3), timeout=10, metadata=md)}
            return seen

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, range(32)))
    assert answers == [{"alice"} if i % 2 else {"bob"} for i in range(32)]


async def test_client_channels_present_the_token_on_every_kind_of_call(who_factory, tmp_path) -> None:
    """Bug: one aio interceptor implementing all four call kinds was filed by grpc.aio under
    unary-unary only, so streams (WritePages) went without the token."""
    from kvstore.security.channel import aio_channel, sync_channel

    server = who_factory(auth_file=write_auth_file(tmp_path / "auth.json", grants()))
    with sync_channel(server.address, token=ALICE) as channel:
        seen = {json.loads(channel.unary_unary("/t.Who/Unary")(b"", timeout=10))["tenant"]}
        seen |= {json.loads(r)["tenant"] for r in channel.unary_stream("/t.Who/Stream")(b"", timeout=10)}
        seen |= {a["tenant"] for a in json.loads(channel.stream_unary("/t.Who/Upload")(iter([b""]), timeout=10))}
        seen |= {json.loads(r)["tenant"] for r in channel.stream_stream("/t.Who/Chat")(iter([b""]), timeout=10)}
    async with aio_channel(server.address, token=BOB) as channel:
        seen_aio = {json.loads(await channel.unary_unary("/t.Who/Unary")(b"", timeout=10))["tenant"]}
        seen_aio |= {json.loads(r)["tenant"] async for r in channel.unary_stream("/t.Who/Stream")(b"", timeout=10)}
        seen_aio |= {a["tenant"] for a in json.loads(await channel.stream_unary("/t.Who/Upload")(iter([b""]), timeout=10))}
        seen_aio |= {json.loads(r)["tenant"] async for r in channel.stream_stream("/t.Who/Chat")(iter([b""]), timeout=10)}
    assert (seen, seen_aio) == ({"alice"}, {"bob"})


def test_the_identity_is_not_visible_outside_the_call(who_factory, tmp_path) -> None:
    """Fail closed: a thread the handler hands work to, or code outside any call, has no caller."""
    server = who_factory(auth_file=write_auth_file(tmp_path / "auth.json", grants()))
    with grpc.insecure_channel(server.address) as channel:
        assert channel.unary_unary("/t.Who/Elsewhere")(b"", timeout=10, metadata=_bearer(ALICE)) == b"unauthenticated"
    with pytest.raises(Unauthenticated):
        current_identity()
    refused: list[str] = []

    def probe() -> None:
        try:
            current_identity()
        except Unauthenticated as exc:
            refused.append(str(exc))

    worker = threading.Thread(target=probe)
    worker.start()
    worker.join()
    assert len(refused) == 1


def test_without_an_auth_file_everyone_is_the_local_tenant_with_every_right(who_factory) -> None:
    server = who_factory()
    with grpc.insecure_channel(server.address) as channel:
        assert _ask(channel) == {"tenant": "local", "rights": ["read", "write", "admin", "node"], "salt": "", "via": "local"}
        assert _ask(channel, token="anything-at-all-0123456")["tenant"] == "local"  # nothing to check it against


def _mtls(ca: CertAuthority, **extra: Any) -> dict[str, Any]:
    server_cert = ca.server_cert()
    return {"tls_cert": server_cert.cert, "tls_key": server_cert.key, "tls_client_ca": ca.cert, **extra}


def test_mtls_the_client_certificate_names_the_tenant(who_factory, ca, tmp_path) -> None:
    certs = [{"subject": "alice.tenants.example", "tenant": "alice", "rights": ["read"]}]
    server = who_factory(**_mtls(ca, auth_file=write_auth_file(tmp_path / "auth.json", grants(), certs)))
    by_san = ca.issue("alice-laptop", dns=("alice.tenants.example",))
    with tls_channel(server.address, ca, by_san) as channel:
        assert _ask(channel) | {"salt": ""} == {"tenant": "alice", "rights": ["read"], "salt": "", "via": "cert"}
        assert _ask(channel, token=BOB)["tenant"] == "bob", "a token, when sent, decides"
    with tls_channel(server.address, ca, ca.issue("mallory")) as channel, pytest.raises(grpc.RpcError) as caught:
        _ask(channel)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "CN='mallory'" in caught.value.details()


def test_mtls_without_an_auth_file_the_common_name_is_the_tenant(who_factory, ca) -> None:
    server = who_factory(**_mtls(ca))
    with tls_channel(server.address, ca, ca.issue("carol")) as channel:
        carol = _ask(channel)
    assert (carol["tenant"], carol["rights"], carol["via"]) == ("carol", ["read", "write"], "cert")
    assert len(bytes.fromhex(carol["salt"])) == 16


def test_mtls_refuses_a_client_without_a_certificate_or_with_one_of_another_ca(who_factory, ca, tmp_path) -> None:
    server = who_factory(**_mtls(ca))
    stranger = CertAuthority(tmp_path / "stranger", "stranger CA")
    for client in (None, stranger.issue("carol")):
        assert client is None or isinstance(client, Issued)
        with tls_channel(server.address, ca, client) as channel, pytest.raises(grpc.RpcError) as caught:
            _ask(channel, token=ALICE)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake failed: no call was made


async def test_mtls_client_stores_pages_as_its_certificates_tenant(server_factory, ca, tmp_path, layout, ns) -> None:
    """End to end on the real server: KVStoreClient with a client certificate and no token."""
    certs = [{"subject": "alice", "tenant": "alice", "rights": ["read", "write"]}]
    config = secure_config(tmp_path, auth_file=write_auth_file(tmp_path / "auth.json", [], certs), tls=ca.server_cert(),
                           client_ca=ca)
    server = server_factory(config)
    alice = ca.issue("alice")
    tokens = list(range(48))
    async with KVStoreClient(server.address, ns, use_shm=False, tls=ClientTLS(ca=ca.cert, cert=alice.cert, key=alice.key)) as c:
        assert await c.put(tokens, random_kv(layout, len(tokens))) == len(tokens)
        assert (await c.lookup(tokens)).num_tokens == len(tokens)
    mallory = ca.issue("mallory")
    with pytest.raises(Unauthenticated):
        async with KVStoreClient(server.address, ns, tls=ClientTLS(ca=ca.cert, cert=mallory.cert, key=mallory.key), timeout_s=10):
            pass


def _open_chat(channel: grpc.Channel, token: str) -> tuple[Callable[[], dict[str, Any]], Callable[[], None]]:
    """A Chat stream whose requests the test sends one at a time: (ask, close)."""
    outbox: queue.Queue[bytes | None] = queue.Queue()
    answers = channel.stream_stream("/t.Who/Chat")(iter(outbox.get, None), timeout=30, metadata=_bearer(token))

    def ask() -> dict[str, Any]:
        outbox.put(b"")
        return json.loads(next(answers))

    return ask, lambda: outbox.put(None)


def test_a_request_stream_ends_when_its_token_is_revoked_or_expires(who_factory, tmp_path) -> None:
    expires = time.time() + 1.0
    auth = write_auth_file(tmp_path / "auth.json", [*grants(), {"tenant": "dave", "rights": ["read"],
                                                                "token": "dave-token-0123456789abcdef", "expires": expires}])
    server = who_factory(auth_file=auth)
    with grpc.insecure_channel(server.address) as channel:
        alice_ask, alice_close = _open_chat(channel, ALICE)
        bob_ask, bob_close = _open_chat(channel, BOB)
        dave_ask, dave_close = _open_chat(channel, "dave-token-0123456789abcdef")
        assert (alice_ask()["tenant"], bob_ask()["tenant"], dave_ask()["tenant"]) == ("alice", "bob", "dave")
        write_auth_file(auth, [g for g in grants() if g["token"] != ALICE] + [json.loads(auth.read_text())["tokens"][-1]])
        assert server.security.reload()
        with pytest.raises(grpc.RpcError) as caught:
            alice_ask()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED and "while the stream was open" in caught.value.details()
        assert bob_ask()["tenant"] == "bob", "a reload ends only the streams of revoked tokens"
        time.sleep(max(0.0, expires - time.time()) + 0.05)  # what is tested is the passing of the expiry time itself
        with pytest.raises(grpc.RpcError) as caught:
            dave_ask()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED and "expired" in caught.value.details()
        assert bob_ask()["tenant"] == "bob"
        for close in (alice_close, bob_close, dave_close):
            close()
