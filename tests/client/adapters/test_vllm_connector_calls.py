"""The vLLM connector's hit path on the server's host goes through the same-host call socket
(kvstore/callsocket/frames.py): the scheduler's lookup+lease and the worker's release, no gRPC."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from support.servers import ServerProcess
from test_vllm_connector_parts import (  # noqa: F401 - store_process is a fixture
    BLOCK,
    NAMES,
    forward,
    new_request,
    num_leases,
    parts,
    step,
    store_process,
    store_prompt,
)

from kvstore._proto import data_pb2


def _recorded(calls: list[str], fn: Callable[..., Any], label: Callable[..., str]) -> Callable[..., Any]:
    """``fn``, noting each call's ``label`` in ``calls`` first (a spy on the real object)."""

    def spy(*args: Any, **kw: Any) -> Any:
        calls.append(label(*args, **kw))
        return fn(*args, **kw)

    return spy


def test_a_small_hit_goes_through_the_call_socket(store_process: ServerProcess) -> None:  # noqa: F811 - the fixture
    tokens = list(range(1, 2 * BLOCK + 2))
    store_prompt(store_process.address, tokens)
    store, scheduler, worker, caches = parts(store_process.address, sync_load_pages=8)
    client = store.client()
    assert client is not None and client.calls.blocking is not None and client.shared_memory
    socket_calls: list[str] = []
    grpc_calls: list[str] = []
    client.calls.blocking.call = _recorded(socket_calls, client.calls.blocking.call, lambda method, *_, **__: method)  # type: ignore[method-assign]
    client.calls.blocking.post = _recorded(socket_calls, client.calls.blocking.post, lambda method, *_, **__: method)  # type: ignore[method-assign]
    client.runtime.rpc = _recorded(grpc_calls, client.runtime.rpc, lambda method, *_, **__: str(method))  # type: ignore[method-assign]
    request = new_request("reader", tokens)
    meta = step(scheduler, "reader", tokens, 0, [10, 11, 12], request)
    assert [(spec.first_page, spec.num_pages) for spec in meta.loads] == [(0, 2)] and meta.loads[0].lease is not None
    forward(worker, meta)
    scheduler.finished(request)
    assert worker.stats.leased_copies == 1 and worker.load_errors() == set()
    assert all(bool((caches[name][10:12] == 1.0 + i).all()) for i, name in enumerate(NAMES))
    assert (socket_calls, grpc_calls) == (["Data.Acquire", "Data.Release"], [])
    client.calls.blocking.call("Data.WhoAmI", data_pb2.WhoAmIRequest(), data_pb2.WhoAmIResponse)  # after the posted release's answer
    assert num_leases(store_process.address) == 0, "the worker gave the lease back"
    store.close()
