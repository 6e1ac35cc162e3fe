"""A hostile or buggy server's error label never raises anything but a KVStoreError in the client
(9de152e: "a label whose fields do not fit comes back as its message, never an exception").

Two labels break that promise: fields of the right names but a wrong type (``quota`` an int:
QuotaExceeded.__init__ calls ``quota.replace`` -> AttributeError, and error_for catches only
TypeError), and fields nested ~1,000 deep (json.loads -> RecursionError, and _fields catches only
ValueError). Both fit gRPC's default metadata limit (8 KiB) and travel as trailing metadata."""

from __future__ import annotations

from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from kvstore import errors
from kvstore.callsocket.client_sync import answer_error
from kvstore.client.runtime import Runtime
from kvstore.status import ERROR_METADATA_KEY, error_for

WRONG_TYPE = '{"held": 1, "limit": 1, "quota": 5, "tenant": "a", "wanted": 1}'
DEEP = "[" * 1000 + "]" * 1000  # 2,000 bytes

LABELS = [f"QuotaExceeded {WRONG_TYPE}", f"QuotaExceeded {DEEP}"]


@pytest.mark.parametrize("label", LABELS, ids=["wrong-type", "deep"])
def test_error_for_never_raises_on_a_hostile_label(label: str) -> None:
    got = error_for(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused", label)
    assert isinstance(got, errors.LimitExceeded) and str(got) == "refused"


@pytest.mark.parametrize("label", LABELS, ids=["wrong-type", "deep"])
def test_the_call_socket_client_never_raises_on_a_hostile_error_line(label: str) -> None:
    got = answer_error(8, f"{label}\nrefused".encode())  # 8: RESOURCE_EXHAUSTED
    assert isinstance(got, errors.KVStoreError)


def _hostile_server(label: str) -> tuple[grpc.Server, int]:
    def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.set_trailing_metadata(((ERROR_METADATA_KEY, label),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused")

    generic = grpc.method_handlers_generic_handler("kvstore.Data", {
        "Allocate": grpc.unary_unary_rpc_method_handler(handler, lambda b: b, lambda b: b)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.mark.parametrize("label", LABELS, ids=["wrong-type", "deep"])
def test_the_grpc_client_never_raises_on_a_hostile_trailing_label(label: str) -> None:
    server, port = _hostile_server(label)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/kvstore.Data/Allocate", lambda b: b, lambda b: b)
            with pytest.raises(grpc.RpcError) as caught:
                call(b"", timeout=5)
        rpc = caught.value
        sent = dict(rpc.trailing_metadata() or ()).get(ERROR_METADATA_KEY)
        assert sent == label, "the label did not travel whole"
        got = Runtime.error(SimpleNamespace(address="127.0.0.1"), rpc)  # type: ignore[arg-type]
        assert isinstance(got, errors.KVStoreError)
    finally:
        server.stop(0)
