"""The cost model: when fetching stored KV beats recomputing it, and where a request gets
its first token soonest.

Units: bytes, seconds, bytes/second (1 GB/s = 1e9 B/s). Every formula is the chapter's
(DESIGN §10); the unit tests reproduce its worked numbers. Bandwidths and
prefill speeds should come from measurement, not constants: ``cost_model.py`` fits them
online from observed fetches and forward passes (the vLLM connector decides its loads
with it, ``kvstore-bench crossover`` predicts with it).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SECONDS_PER_DAY = 86_400

# -- sizes and transfers ---------------------------------------------------------------


def kv_bytes_per_token_gqa(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of every layer: 2·n·h_kv·d_h·b."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def transfer_s(num_bytes: float, bandwidth_bps: float, latency_s: float = 0.0) -> float:
    return latency_s + num_bytes / bandwidth_bps


def production_rate(num_bytes: float, recompute_s: float) -> float:
    """r: bytes of KV a prefill produces per second. It is also the crossover bandwidth:
    a fetch (V/B) beats recompute (V/r) exactly when B > r."""
    return num_bytes / recompute_s


def tie_bandwidth(num_bytes: float, target_s: float, fixed_s: float = 0.0) -> float:
    """The link bandwidth at which fixed_s + V/B equals target_s."""
    if target_s <= fixed_s:
        return math.inf
    return num_bytes / (target_s - fixed_s)


# -- store, fetch, recompute ------------------------------------------------------------


def reuses_to_win(write_s: float, read_s: float, recompute_s: float) -> int | None:
    """The least k for which storing then fetching beats recomputing k times; None when a
    fetch is no faster than recompute (then no number of reuses pays)."""
    if read_s >= recompute_s:
        return None
    return max(1, math.floor(write_s / (recompute_s - read_s)) + 1)


# -- layer-wise loading ----------------------------------------------------------------


def layerwise_s(num_layers: int, read_layer_s: float, compute_layer_s: float, preloaded: int = 0) -> float:
    """Prefill time when layer i's compute waits for layer i's read, reads run back to back
    on their own stream, and the first ``preloaded`` layers are already in place."""
    read_done = 0.0
    compute_end = 0.0
    for layer in range(num_layers):
        if layer >= preloaded:
            read_done += read_layer_s
        ready = read_done if layer >= preloaded else 0.0
        compute_end = max(compute_end, ready) + compute_layer_s
    return compute_end


def prefetch_buffer_bytes(bandwidth_bps: float, read_s: float, new_s: float) -> float:
    """S_buf = B·(T_read − T_new): what must be loaded before compute starts so that the
    rest of the read hides behind compute. Zero when compute is the longer of the two."""
    return max(0.0, bandwidth_bps * (read_s - new_s))


def preload_layers(num_layers: int, bandwidth_bps: float, read_s: float, new_s: float) -> int:
    """The least ``ahead`` (layers loaded before compute starts) with which a layer-wise
    load never stalls compute: S_buf rounded up to whole layers, checked by simulating the
    pipeline (a layer more is needed when the buffer lands just past a layer boundary)."""
    if prefetch_buffer_bytes(bandwidth_bps, read_s, new_s) == 0:
        return 0  # compute is the longer: only the first layer's read is exposed
    read_layer, compute_layer = read_s / num_layers, new_s / num_layers
    floor = math.floor(prefetch_buffer_bytes(bandwidth_bps, read_s, new_s) / (bandwidth_bps * read_layer)) if read_layer > 0 else 0
    for ahead in range(max(0, floor), num_layers + 1):
        if layerwise_s(num_layers, read_layer, compute_layer, ahead) <= new_s * (1 + 1e-9) + 1e-12:
            return ahead
    return num_layers


# -- time to first token ---------------------------------------------------------------


def time_to_first_token(queue_s: float, ready_s: float, compute_s: float, overlap: bool = True) -> float:
    """max(Q, R) + C when the fetch runs while the request waits in the queue; Q + R + C
    when it cannot start before the GPU frees."""
    return (max(queue_s, ready_s) if overlap else queue_s + ready_s) + compute_s


def expected_first_token_s(p_hit: float, hit_s: float, miss_s: float) -> float:
    return p_hit * hit_s + (1 - p_hit) * miss_s


def quantile_first_token_s(p_hit: float, hit_s: float, miss_s: float, q: float = 0.99) -> float:
    """The q-quantile of a two-point outcome: the hit time only if hits cover q."""
    return hit_s if p_hit >= q - 1e-12 else miss_s


# -- endurance -------------------------------------------------------------------------


def ssd_write_budget_bps(capacity_bytes: float, dwpd: float) -> float:
    """Long-run write rate an SSD's endurance allows: capacity × DWPD / 86,400."""
    return capacity_bytes * dwpd / SECONDS_PER_DAY


# -- routing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillModel:
    """Prefill seconds for a number of new tokens: linear interpolation in measured points
    (tokens, seconds), extrapolated by the last segment's slope; or a rate."""

    points: tuple[tuple[int, float], ...] = ()
    tokens_per_s: float = 0.0

    def seconds(self, new_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        if not self.points:
            if self.tokens_per_s <= 0:
                raise ValueError("PrefillModel needs measured points or tokens_per_s")
            return new_tokens / self.tokens_per_s
        pts = sorted(self.points)
        if len(pts) == 1:
            return pts[0][1] * new_tokens / pts[0][0]
        xs = [p[0] for p in pts]
        i = min(max(bisect.bisect_left(xs, new_tokens), 1), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (new_tokens - x0) / (x1 - x0)


@dataclass(frozen=True)
class Request:
    prompt_tokens: int
    bytes_per_token: float


@dataclass(frozen=True)
class Candidate:
    """An instance a router may send the request to, with what it holds and its links."""

    name: str
    queue_s: float
    prefill: PrefillModel
    hbm_tokens: int = 0            # prefix tokens already in this instance's GPU memory
    host_tokens: int = 0           # ... in its host RAM tier
    ssd_tokens: int = 0            # ... on its local SSD
    remote_tokens: int = 0         # ... fetchable from another node or pool
    pcie_bps: float = 25e9         # host -> GPU
    ssd_bps: float = 7.1e9         # SSD -> host
    network_bps: float = 0.0       # remote -> host; 0: no fetch path
    lookup_s: float = 0.0          # directory lookup before a fetch
    hit_probability: float = 1.0   # how sure the router is that the cached prefix is really there
    overlap: bool = True           # can the fetch run while the request waits in the queue


@dataclass(frozen=True)
class Option:
    candidate: str
    path: str            # "local-hbm", "local-host", "local-ssd", "fetch", "recompute"
    cached_tokens: int
    queue_s: float
    ready_s: float
    compute_s: float
    first_token_s: float
    expected_s: float
    p99_s: float
    why: str


def _options(req: Request, cand: Candidate) -> list[Option]:
    out = []

    def add(path: str, cached: int, ready: float, why: str) -> None:
        compute = cand.prefill.seconds(req.prompt_tokens - cached)
        first = time_to_first_token(cand.queue_s, ready, compute, cand.overlap)
        miss = time_to_first_token(cand.queue_s, 0.0, cand.prefill.seconds(req.prompt_tokens), cand.overlap)
        p = cand.hit_probability if cached else 1.0
        out.append(Option(cand.name, path, cached, cand.queue_s, ready, compute, first,
                          expected_first_token_s(p, first, miss), quantile_first_token_s(p, first, miss), why))

    v = req.bytes_per_token
    if cand.hbm_tokens:
        add("local-hbm", cand.hbm_tokens, 0.0, "prefix already in GPU memory")
    if cand.host_tokens:
        add("local-host", cand.host_tokens, transfer_s(cand.host_tokens * v, cand.pcie_bps),
            f"{cand.host_tokens} tokens over PCIe at {cand.pcie_bps / 1e9:.2f} GB/s")
    if cand.ssd_tokens:
        n = cand.ssd_tokens * v
        add("local-ssd", cand.ssd_tokens, transfer_s(n, cand.ssd_bps) + transfer_s(n, cand.pcie_bps),
            f"{cand.ssd_tokens} tokens from SSD at {cand.ssd_bps / 1e9:.2f} GB/s, then PCIe")
    if cand.remote_tokens and cand.network_bps > 0:
        n = cand.remote_tokens * v
        add("fetch", cand.remote_tokens, cand.lookup_s + transfer_s(n, cand.network_bps) + transfer_s(n, cand.pcie_bps),
            f"lookup {cand.lookup_s * 1e3:.0f} ms, {cand.remote_tokens} tokens over {cand.network_bps / 1e9:.2f} GB/s, then PCIe")
    add("recompute", 0, 0.0, f"prefill all {req.prompt_tokens} tokens")
    return out


@dataclass
class Plan:
    objective: str
    ranking: list[Option]
    assignment: dict[int, Option] = field(default_factory=dict)
    makespan_s: float = 0.0

    @property
    def best(self) -> Option:
        return self.ranking[0]

    def to_dict(self) -> dict[str, Any]:
        def opt(o: Option) -> dict[str, Any]:
            return {k: (round(v * 1e3, 3) if k.endswith("_s") else v) for k, v in o.__dict__.items()} | {"unit": "ms"}

        doc: dict[str, Any] = {"objective": self.objective, "ranking": [opt(o) for o in self.ranking]}
        if self.assignment:
            doc["assignment"] = {str(i): opt(o) for i, o in self.assignment.items()}
            doc["makespan_ms"] = round(self.makespan_s * 1e3, 3)
        return doc


def route(request: Request, candidates: Sequence[Candidate], objective: str = "latency") -> Plan:
    """Ranks every (candidate, path) by first-token time: ``latency`` uses the time if the
    cache is where the router thinks, ``expected`` weights it by hit probability, ``p99``
    the tail."""
    key = {"latency": "first_token_s", "expected": "expected_s", "p99": "p99_s"}.get(objective)
    if key is None:
        raise ValueError(f"objective must be latency, expected or p99 (use route_batch for makespan), got {objective!r}")
    options = [o for c in candidates for o in _options(request, c)]
    return Plan(objective, sorted(options, key=lambda o: (getattr(o, key), o.first_token_s)))


def route_batch(requests: Sequence[Request], candidates: Sequence[Candidate], per_request: Sequence[Sequence[Candidate]] | None = None) -> Plan:
    """Makespan objective: places requests one by one (longest first) where the whole batch
    finishes soonest, each placement adding its compute to that instance's queue.
    ``per_request[i]`` may give request i its own view of the candidates (what each holds)."""
    views = per_request or [candidates] * len(requests)
    busy = {c.name: c.queue_s for c in candidates}
    order = sorted(range(len(requests)), key=lambda i: -requests[i].prompt_tokens)
    assignment: dict[int, Option] = {}
    for i in order:
        best: tuple[float, float, Option] | None = None
        for cand in views[i]:
            shifted = Candidate(**{**cand.__dict__, "queue_s": busy[cand.name]})
            for opt in _options(requests[i], shifted):
                finish = opt.first_token_s
                span = max([finish] + [b for n, b in busy.items() if n != cand.name])
                if best is None or (span, finish) < (best[0], best[1]):
                    best = (span, finish, opt)
        assert best is not None
        assignment[i] = best[2]
        busy[best[2].candidate] = best[1]
    return Plan("makespan", sorted(assignment.values(), key=lambda o: o.first_token_s), assignment, max(busy.values()))


def request_from_dict(doc: dict[str, Any]) -> tuple[Request, list[Candidate], str]:
    """Parses ``kvstore-ctl plan`` input: {"request": {...}, "candidates": [...], "objective": ...}."""
    req = Request(**doc["request"])
    cands = []
    for c in doc["candidates"]:
        c = dict(c)
        pf = c.pop("prefill")
        model = PrefillModel(tuple(tuple(p) for p in pf.get("points", ())), pf.get("tokens_per_s", 0.0))  # type: ignore[misc]
        cands.append(Candidate(prefill=model, **c))
    return req, cands, doc.get("objective", "latency")
