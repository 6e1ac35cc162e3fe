"""Random traffic through the vLLM connector's parts, checked after every step against a model of
namespace generations (DESIGN §3): requests looked up (hits, misses, prompts under a page), their
layer-wise saves, prefills handing off to decodes that carry ``kvstore_generation``, acknowledged
invalidations, and the store process killed or stopped and started again. Checked: (a) once an
invalidation is acknowledged, no page of an older generation is found or served; (b) a request that
named the current generation, with no invalidation or restart while it ran, has its pages stored;
(c) once the requests end, nothing is left: no lease, allocation, held block or request state.
Seeded; GENERATION_MODEL_SEEDS=N adds N seeds, GENERATION_MODEL_SEED=S runs S alone."""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from generation_engine import BLOCK, LAYOUT, NUM_BLOCKS, Engine, Scheduled, StepResult, generation_of, tag
from support.servers import ServerProcess
from tenant_store import TOKEN_A, TOKEN_OPS, stop, tenant_server

from kvstore import Namespace
from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client.adapters.connection import StoreConnection
from kvstore.security.credentials import Credentials

CI_SEEDS = [3, 14]  # 3: pages over gRPC, a kill, a decode waiting before its prefill completes; 14: shared memory, 6 handoffs
STEPS = int(os.environ.get("GENERATION_MODEL_STEPS", "25"))
FAMILIES = [[1000 * (f + 1) + i for i in range(3 * BLOCK)] for f in range(3)]  # shared prefixes: hits


def _seeds() -> list[int]:
    if os.environ.get("GENERATION_MODEL_SEED"):
        return [int(os.environ["GENERATION_MODEL_SEED"])]
    return CI_SEEDS + list(range(100, 100 + int(os.environ.get("GENERATION_MODEL_SEEDS", "0"))))


@dataclass
class Req:
    number: int
    request: SimpleNamespace
    kind: str  # plain, short, prefill, decode
    generation: int  # the model's: the generation its KV is computed in (its lookup's; a decode's, its prefill's)
    epoch: int  # restarts before it came
    max_tokens: int
    named: int | None = None  # what its saves name (the connector's RequestState.generation)
    computed: int = 0
    new: bool = True
    saved_pages: int = 0  # the end of its furthest save

    @property
    def req_id(self) -> str:
        return str(self.request.request_id)


class Checker:
    """The operator's and the model's view of the store: another client of the same tenant."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.conn = StoreConnection(address, Namespace(model="generation-model", revision="r", layout=LAYOUT), use_shm=False,
                                    credentials=Credentials(TOKEN_A))
        assert self.conn.start(), "the checker did not connect"

    def bind(self) -> None:
        """A first write, which binds the namespace to tenant a: it may invalidate it from then on."""
        client = self._client()
        kv = torch.full((LAYOUT.num_layers, 2, BLOCK, LAYOUT.num_kv_heads, LAYOUT.head_dim), tag(0, 1))
        assert self.conn.run(client, client.put([7] * BLOCK, kv), 10) == BLOCK

    def _client(self) -> Any:
        client = self.conn.client()
        assert client is not None, "the checker's connection dropped"
        return client

    def invalidate(self) -> int:
        client = self._client()
        return int(self.conn.run(client, client.invalidate(), 10))

    def stored(self, tokens: list[int]) -> tuple[int, int, set[int]]:
        """Leading pages stored, the generation the lookup read, and the generations of the tags in them."""
        client = self._client()
        hit = self.conn.run(client, client.lookup(tokens), 10)
        if not hit.num_pages:
            return 0, hit.generation, set()
        into = torch.empty(LAYOUT.num_layers, 2, hit.num_pages * BLOCK, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        self.conn.run(client, client.get(hit, into), 10)
        return hit.num_pages, hit.generation, {generation_of(v) for v in into.unique().tolist()}

    def held(self) -> dict[str, int]:
        """What tenant a holds at the server (the admin's Stats): leases, allocations."""
        with grpc.insecure_channel(self.address) as channel:
            stats = directory_pb2_grpc.DirectoryStub(channel).Stats(
                directory_pb2.StatsRequest(), timeout=10, metadata=[("authorization", f"Bearer {TOKEN_OPS}")])
        used = {t.tenant: dict(t.used) for t in stats.tenants}.get("a", {})
        return {"num_leases": int(stats.num_leases), "leases": used.get("leases", 0), "allocations": used.get("allocations", 0)}


class Traffic:
    """The model and the random operations on the engine, the store and the operator."""

    def __init__(self, server: ServerProcess, rng: random.Random, use_shm: bool) -> None:
        self.server, self.rng = server, rng
        self.up, self.current, self.epoch = True, 0, 0
        self.engine = Engine(server.address, TOKEN_A, use_shm)
        self.checker = Checker(server.address)
        self.checker.bind()
        self.stale: list[object] = []  # the connector's clients of servers since stopped
        self.numbers = itertools.count(1)
        self.arrived: list[Req] = []  # looked up, scheduled in the next step
        self.running: dict[str, Req] = {}
        self.waiting: dict[str, Req] = {}  # decodes waiting for their handed-off pages
        self.ending: dict[str, Req] = {}  # finished; blocks held until the workers report them
        self.handed: list[tuple[dict[str, Any], Req]] = []  # what prefills returned, for decodes to come
        self.watched: list[list[int]] = [family + [1] for family in FAMILIES]
        self.log: list[str] = []

    # -- operations ----------------------------------------------------------------------

    def arrive(self, kind: str) -> None:
        rng, number = self.rng, next(self.numbers)
        if kind == "short":
            prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, BLOCK))]
        else:
            family = rng.choice(FAMILIES)
            prompt = family[: rng.randrange(1, len(family) + 1)] + [rng.randrange(10**5, 10**6) for _ in range(rng.randrange(0, 2 * BLOCK))]
        params = {"do_remote_decode": True} if kind == "prefill" else None
        request = SimpleNamespace(request_id=f"{kind}{number}", prompt_token_ids=prompt, all_token_ids=list(prompt),
                                  kv_transfer_params=params, status=SimpleNamespace(name="RUNNING"), num_computed_tokens=0)
        self._admit(Req(number, request, kind, self.current, self.epoch, 1 if kind == "prefill" else rng.randrange(1, BLOCK + 8)))

    def arrive_decode(self) -> None:
        params, prefill = self.handed.pop(self.rng.randrange(len(self.handed)))
        prompt = list(prefill.request.prompt_token_ids)
        number = next(self.numbers)
        request = SimpleNamespace(request_id=f"decode{number}", prompt_token_ids=prompt, all_token_ids=list(prompt),
                                  kv_transfer_params=dict(params), status=SimpleNamespace(name="RUNNING"), num_computed_tokens=0)
        self._admit(Req(number, request, "decode", prefill.generation, self.epoch, self.rng.randrange(1, BLOCK + 8)), prefill.named)

    def _admit(self, req: Req, prefill_named: int | None = None) -> None:
        client = self.engine.store.client()
        answers = self.up and client is not None and all(client is not c for c in self.stale)
        hit, later = self.engine.matched(req.request)
        self.engine.alloc(req.request, len(req.request.prompt_token_ids) + req.max_tokens, hit)
        state = self.engine.scheduler.requests.get(req.req_id)
        assert state is not None, f"{req.req_id} is not tracked"
        req.named, req.computed = state.generation, hit
        self.log.append(f"{req.req_id}: {len(req.request.prompt_token_ids)} tokens, hit {hit}, named {req.named}, "
                        f"model {req.generation}{'' if answers else ' (store not answering)'}")
        if req.kind == "decode":  # the prefill's, which may be a lower bound (a prefill that came while the store was away)
            assert req.named == prefill_named, f"{req.req_id} names {req.named}, not its prefill's {prefill_named}"
        elif answers:
            assert req.named == self.current, f"{req.req_id} was looked up in {self.current} and names {req.named}"
        if later:
            self.waiting[req.req_id] = req
        else:
            self.arrived.append(req)
        if len(req.request.prompt_token_ids) >= BLOCK:  # a lookup of no page reads no generation
            self.watched = (self.watched + [list(req.request.prompt_token_ids)])[-12:]

    def invalidate(self) -> None:
        generation = self.checker.invalidate()
        assert generation == self.current + 1, f"invalidate answered {generation}, the model is at {self.current}"
        self.current = generation
        self.log.append(f"invalidated: generation {generation}")

    def stop(self, how: str) -> None:
        self.stale.append(self.engine.store.client())
        self.checker.conn.close()
        if how == "kill":
            self.server.kill()
        else:
            self.server.terminate()
        self.up, self.epoch = False, self.epoch + 1
        self.log.append(f"store stopped ({how})")

    def start(self) -> None:
        self.server.start()
        self.checker = Checker(self.server.address)
        self.up = True
        self.log.append("store started")

    def step(self) -> None:
        scheduled = [Scheduled(r.request, r.computed, len(r.request.all_token_ids) - r.computed, tag(r.generation, r.number), r.new)
                     for r in self.arrived + list(self.running.values())]
        for req in self.arrived:
            self.running[req.req_id] = req
        self.arrived = []
        result = self.engine.step(scheduled)
        self.log.append(f"step: {[(s.request.request_id, s.computed, s.num_tokens) for s in scheduled]}, "
                        f"saves {[(s.req_id, s.first_page, len(s.tokens) // BLOCK, s.generation) for s in result.meta.saves]}, "
                        f"loads {[(s.req_id, s.first_page, s.num_pages) for s in result.meta.loads]}, errors {sorted(result.load_errors)}")
        for spec in result.meta.saves:
            req = self.running.get(spec.req_id) or self.ending[spec.req_id]
            req.saved_pages = max(req.saved_pages, len(spec.tokens) // BLOCK)
            assert spec.generation == req.named, f"a save of {spec.req_id} names {spec.generation}, its request {req.named}"
        for spec in result.meta.loads:
            self._served(self.running[spec.req_id], spec.first_page, spec.num_pages, result.load_errors)
        for s in scheduled:
            self._advance(self.running[s.request.request_id], s, result.load_errors)
        self._released(result)

    def _served(self, req: Req, first_page: int, num_pages: int, errors: set[int]) -> int:
        """(a) for what a load put in the request's blocks: KV of its own generation or newer, never
        older; returns the leading pages that loaded."""
        blocks = self.engine.blocks[req.req_id]
        valid = next((i for i in range(first_page, first_page + num_pages) if blocks[i] in errors), first_page + num_pages)
        if valid > first_page:
            generations = {generation_of(v) for v in self.engine.tags(req.req_id, first_page, valid - first_page)}
            assert generations and min(generations) >= req.generation and max(generations) <= self.current, \
                f"{req.req_id} (generation {req.generation}) was served KV of generations {generations}"
        return valid

    def _advance(self, req: Req, s: Scheduled, errors: set[int]) -> None:
        failed = [i for i, block in enumerate(self.engine.blocks[req.req_id]) if block in errors]
        req.new = False
        if failed:  # vLLM recomputes from the first block that failed to load
            req.computed = failed[0] * BLOCK
            return
        req.computed = s.computed + s.num_tokens
        request = req.request
        request.all_token_ids.append(self.rng.randrange(1, 500))  # the token sampled
        if len(request.all_token_ids) - len(request.prompt_token_ids) < req.max_tokens:
            return
        request.num_computed_tokens = req.computed
        del self.running[req.req_id]
        params = self.engine.finish(request)
        if req.kind == "prefill":
            assert params is not None and params.get("kvstore_generation") == req.named, \
                f"prefill {req.req_id} named {req.named} and handed {params}"
            self.handed.append((params, req))
        if req.req_id in self.engine.blocks:
            self.ending[req.req_id] = req
        else:
            self._ended(req)

    def _released(self, result: StepResult) -> None:
        for req_id in result.sending & self.ending.keys():
            self._ended(self.ending.pop(req_id))
        for req_id in result.recving & self.waiting.keys():
            req = self.waiting.pop(req_id)
            req.computed = self._served(req, 0, req.computed // BLOCK, result.load_errors) * BLOCK
            self.arrived.append(req)

    def _ended(self, req: Req) -> None:
        """(b): a request that named the current generation and saw nothing change has its pages stored."""
        unchanged = self.up and req.epoch == self.epoch and req.named == req.generation == self.current
        self.log.append(f"{req.req_id} ended: {req.saved_pages} pages saved{'' if unchanged else ' (exempt)'}")
        if unchanged and req.saved_pages:
            pages, generation, _ = self.checker.stored(req.request.all_token_ids[: req.saved_pages * BLOCK])
            assert (pages, generation) == (req.saved_pages, self.current), \
                f"{req.req_id} saved {req.saved_pages} pages in generation {req.named}: {pages} stored, in {generation}"

    # -- the invariants after each step -------------------------------------------------------

    def check(self) -> None:
        if self.up:
            for tokens in self.watched:  # (a)
                pages, generation, generations = self.checker.stored(tokens)
                assert generation == self.current, f"a lookup read generation {generation}, the model is at {self.current}"
                assert generations <= {self.current}, \
                    f"{pages} pages of generations {generations} found after the invalidation to {self.current}"
        if not (self.arrived or self.running or self.waiting or self.ending or self.engine.holds_blocks):
            self.left_behind()

    def left_behind(self) -> None:
        """(c): no request state, no held block; at the server no lease or allocation of the tenant."""
        assert not self.engine.scheduler.requests and sorted(self.engine.free) == list(range(NUM_BLOCKS)), \
            f"left: requests {list(self.engine.scheduler.requests)}, blocks of {list(self.engine.blocks)}"
        if not self.up:
            return
        deadline = time.monotonic() + 5  # releases are sent in the background; leases live 30 s
        while any((held := self.checker.held()).values()):
            assert time.monotonic() < deadline, f"held at the server after the requests ended: {held}"
            time.sleep(0.05)

    def drain(self) -> None:
        """Ends the traffic: the store up, every request (and a decode for every handoff) to its end."""
        if not self.up:
            self.start()
        deadline = time.monotonic() + 30
        while self.handed or self.arrived or self.running or self.waiting or self.ending or self.engine.holds_blocks:
            assert time.monotonic() < deadline, f"requests never ended: {list(self.running)}, {list(self.waiting)}"
            if self.handed and len(self.engine.free) >= 12:
                self.arrive_decode()
            self.step()
            self.check()
            time.sleep(0.01 if self.waiting or self.ending else 0)
        self.left_behind()


def _run(traffic: Traffic, steps: int) -> None:
    rng = traffic.rng
    for _ in range(steps):
        op = rng.choices(["plain", "short", "prefill", "decode", "step", "invalidate", "restart"],
                         [4, 1, 2, 2, 8, 1.5, 0.6])[0]
        if op == "decode" and not traffic.handed:
            op = "step"
        if not traffic.up and (op in ("invalidate", "restart") or rng.random() < 0.3):
            op = "start"  # nothing acknowledges an invalidation while the store is away
        if op in ("plain", "short", "prefill") and len(traffic.engine.free) < 12:
            op = "step"
        if op in ("plain", "short", "prefill"):
            traffic.arrive(op)
        elif op == "decode" and len(traffic.engine.free) >= 12:
            traffic.arrive_decode()
        elif op in ("step", "decode"):
            traffic.step()
        elif op == "invalidate":
            traffic.invalidate()
        elif op == "restart":
            traffic.stop(rng.choice(["kill", "term"]))
            if rng.random() < 0.5:
                traffic.start()
        else:
            traffic.start()
        traffic.check()
    traffic.drain()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ServerProcess]:
    server = tenant_server(tmp_path)
    yield server
    stop(server)


@pytest.mark.parametrize("seed", _seeds())
def test_random_traffic_keeps_the_generation_invariants(store: ServerProcess, seed: int) -> None:
    rng = random.Random(seed)
    traffic = Traffic(store, rng, use_shm=seed % 2 == 0)
    try:
        _run(traffic, STEPS)
    except AssertionError as exc:
        tail = "\n".join(traffic.log[-25:])
        raise AssertionError(f"seed {seed} ({STEPS} steps): {exc}\nlast steps:\n{tail}\nreproduce: GENERATION_MODEL_SEED={seed} "
                             f"GENERATION_MODEL_STEPS={STEPS} .venv/bin/python -m pytest "
                             f"tests/client/adapters/test_vllm_generation_model.py") from exc
    finally:
        traffic.engine.close()
        traffic.checker.conn.close()
