"""The online cost model: what fetching stored KV costs and what recomputing it costs, as
measured where the work is done, and how much of a hit is worth loading.

More: kvstore/README.md (### cost_model.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# Priors: this project's own measurements of its transports on a 2-vCPU host
# (DESIGN §10): a shared-memory get ~5.7 GB/s, a Python gRPC page read 0.6-1.5 GB/s.
SHM_PRIOR_BPS = 5e9
GRPC_PRIOR_BPS = 1e9
PER_CALL_PRIOR_S = 1e-3
# LoadCosts: a size skipped this many times in a row is loaded once, to be measured again; a
# fetch this far off its size class's mean restarts the class (a link that changed speed)
PROBE_EVERY = 40
FETCH_RESTART_FACTOR = 2.0


@dataclass(frozen=True)
class Line:
    """``seconds = fixed_s + per_unit_s * units`` (units: bytes for a fetch, tokens for a
    forward pass)."""

    fixed_s: float
    per_unit_s: float

    def seconds(self, units: float) -> float:
        return self.fixed_s + self.per_unit_s * units


def fetch_prior(shared_memory: bool) -> Line:
    """What a fetch is assumed to cost before this client measured one: a millisecond per
    call and the bandwidth this project measured for the transport. Optimistic on
    purpose: with it the first hit loads, as it always did, and so gets measured (a prior
    that never loads could never learn that loading pays); a first load over a slower link
    than assumed is bounded by the load deadline, and its time is then measured."""
    return Line(PER_CALL_PRIOR_S, 1.0 / (SHM_PRIOR_BPS if shared_memory else GRPC_PRIOR_BPS))


def recompute_prior(tokens_per_s: float) -> Line:
    """What a forward pass is assumed to cost before the engine reported a step: the
    client's configured prefill speed (``prefill_tokens_per_s``). Only the slope decides a
    load (a step's fixed cost is paid whether the hit is loaded or not)."""
    return Line(0.0, 1.0 / tokens_per_s)


@dataclass
class _Bucket:
    """Observations of one size class (a power of two of units): their running means.
    Points of a line average to a point of the same line, so a bucket's mean stays on it."""

    units: float
    seconds: float
    count: int
    seen_at: float


class LinearCost:
    """A line fitted online to (units, seconds) observations.

    Observations are kept as running means per size class (a power of two of units; the
    last ``window`` of each class weigh in), so that many small observations (decode steps,
    one-page loads) do not wash out the few large ones that pin the slope. The line is a
    least-squares fit through the classes weighted for relative error (costs span orders
    of magnitude; a millisecond matters for a small call, not for a large one), with
    ``fixed_s >= 0``. With no observation it is ``prior``. With one size class, or a fitted
    slope that is not positive (noise larger than the slope: decode steps and a short
    prefill on a loaded host), the prior's slope is kept and the line moved through the
    observations (one size cannot tell a per-call cost from a bandwidth, and no unit of
    work is free). ``seconds`` predicts a size already seen from its
    class (the line plus the class's offset from it). Classes not observed for ``max_age_s`` are forgotten,
    so an estimate that stopped being refreshed falls back to the prior. ``restart_factor``: an
    observation more than that factor off its class's mean starts the class again from it (a
    link that got slow or fast is followed at its next observation, not over ``window`` of them).

    Thread-safe."""

    def __init__(self, prior: Line, *, window: int = 32, max_age_s: float | None = None,
                 restart_factor: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        if restart_factor is not None and restart_factor <= 1:
            raise ValueError("restart_factor must be > 1")
        self.prior = prior
        self.window = window
        self.max_age_s = max_age_s
        self.restart_factor = restart_factor
        self._clock = clock
        self._buckets: dict[int, _Bucket] = {}
        self._lock = threading.Lock()
        self.num_observations = 0

    def observe(self, units: float, seconds: float) -> None:
        """Adds one observation; a negative or non-finite one is ignored."""
        if not (math.isfinite(units) and math.isfinite(seconds)) or units < 0 or seconds < 0:
            return
        key = _size_class(units)
        with self._lock:
            now = self._clock()
            bucket = self._buckets.get(key)
            if bucket is None or self._surprising(bucket, units, seconds):
                self._buckets[key] = _Bucket(units, seconds, 1, now)
            else:
                bucket.count += 1
                alpha = 1.0 / min(bucket.count, self.window)
                bucket.units += alpha * (units - bucket.units)
                bucket.seconds += alpha * (seconds - bucket.seconds)
                bucket.seen_at = now
            self.num_observations += 1

    def _surprising(self, bucket: _Bucket, units: float, seconds: float) -> bool:
        """Whether ``seconds`` lies more than ``restart_factor`` outside what the class's mean
        allows at ``units`` (between its mean time and that time scaled to ``units``: a size
        class spans 2x, whether its cost is fixed or per unit)."""
        if self.restart_factor is None:
            return False
        scaled = bucket.seconds * units / bucket.units if bucket.units > 0 else bucket.seconds
        low, high = min(bucket.seconds, scaled), max(bucket.seconds, scaled)
        return seconds > high * self.restart_factor or seconds * self.restart_factor < low

    def line(self) -> Line:
        """The fitted line (the prior before any observation)."""
        return self._fit()[0]

    def seconds(self, units: float) -> float:
        """The predicted cost of ``units``: the line, moved by how far the observations of
        that size class lie off it (real costs bend: flow-control windows, caches), so a
        size seen before is predicted from what it cost, a size never seen from the line."""
        line, buckets = self._fit()
        bucket = buckets.get(_size_class(units))
        off = bucket.seconds - line.seconds(bucket.units) if bucket is not None else 0.0
        return max(0.0, line.seconds(units) + off)

    def _fit(self) -> tuple[Line, dict[int, _Bucket]]:
        with self._lock:
            if self.max_age_s is not None:
                oldest = self._clock() - self.max_age_s
                self._buckets = {k: b for k, b in self._buckets.items() if b.seen_at >= oldest}
            buckets = {k: _Bucket(b.units, b.seconds, b.count, b.seen_at) for k, b in self._buckets.items()}
        # relative errors count: a class's weight is its count over its seconds squared
        points = [(b.units, b.seconds, min(b.count, self.window) / max(b.seconds, 1e-9) ** 2) for b in buckets.values()]
        return _fit(points, self.prior), buckets


def _size_class(units: float) -> int:
    return math.frexp(units)[1] if units > 0 else 0


def _fit(points: list[tuple[float, float, float]], prior: Line) -> Line:
    """Weighted least squares of (x, y, weight) points, kept non-negative."""
    if not points:
        return prior
    total = sum(w for _, _, w in points)
    mx = sum(w * x for x, _, w in points) / total
    my = sum(w * y for _, y, w in points) / total
    sxx = sum(w * (x - mx) ** 2 for x, _, w in points)
    if len(points) == 1 or sxx <= 1e-12 * max(mx * mx, 1e-300) * total:
        slope = prior.per_unit_s
    else:
        slope = sum(w * (x - mx) * (y - my) for x, y, w in points) / sxx
    if slope <= 0:  # no cost per unit is not physical: noise hides the slope, so keep the prior's
        slope = prior.per_unit_s
    fixed = my - slope * mx
    if fixed < 0:  # through the origin instead
        sxx0 = sum(w * x * x for x, _, w in points)
        return Line(0.0, sum(w * x * y for x, y, w in points) / sxx0 if sxx0 > 0 else 0.0)
    return Line(fixed, slope)


def tokens_worth_loading(hit_tokens: int, fetch_s: float, recompute_s: float) -> int:
    """How many leading tokens of a hit to load (the rest is recomputed), given what
    fetching the whole hit costs and what recomputing it costs (its tokens' share of a
    forward pass: the step's fixed cost is paid either way).

    Both costs are linear in the tokens loaded, so each further page costs the same to
    fetch and saves the same recompute: the hit is loaded whole when its fetch is the
    cheaper (the per-token fetch is, and the hit is long enough to pay the per-call cost),
    otherwise not at all."""
    return hit_tokens if hit_tokens > 0 and fetch_s < recompute_s else 0


class LoadCosts:
    """The two measured costs of one engine's loads and the decision made from them:
    ``fetch`` in bytes (this client's loads), ``recompute`` in scheduled tokens (the
    engine's forward passes).

    A hit that is not loaded is not measured, so an estimate too slow would never be
    corrected: a size skipped ``PROBE_EVERY`` times in a row is loaded once (a probe), and
    what it measures replaces the class's estimate if it is off by more than
    ``FETCH_RESTART_FACTOR`` (so does any fetch observation: a link that got slow is skipped
    from its next hit on). A probe costs at most its load deadline, twice the recompute, so
    probing a link that stays slow adds at most 2/PROBE_EVERY (5 %) to what recomputing
    costs. A fetch estimate not refreshed for ``fetch_max_age_s`` also falls back to the
    prior. Called from one thread (the scheduler's)."""

    def __init__(self, bytes_per_token: float, fetch: Line, recompute: Line, fetch_max_age_s: float | None = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bytes_per_token = bytes_per_token
        self.fetch = LinearCost(fetch, max_age_s=fetch_max_age_s, restart_factor=FETCH_RESTART_FACTOR, clock=clock)
        self.recompute = LinearCost(recompute, clock=clock)
        self._skipped: dict[int, int] = {}  # size class of a hit's bytes -> hits of it skipped in a row
        self.num_probes = 0  # hits loaded as probes (never reset)

    def worth_loading(self, hit_tokens: int) -> int:
        load = tokens_worth_loading(hit_tokens, self.fetch_s(hit_tokens), self.recompute_s(hit_tokens))
        if hit_tokens <= 0:
            return load
        key = _size_class(hit_tokens * self.bytes_per_token)
        skipped = 0 if load else self._skipped.get(key, 0) + 1
        if skipped >= PROBE_EVERY:
            skipped, load = 0, hit_tokens
            self.num_probes += 1
        self._skipped[key] = skipped
        return load

    def fetch_s(self, tokens: int) -> float:
        return self.fetch.seconds(tokens * self.bytes_per_token)

    def recompute_s(self, tokens: int) -> float:
        return tokens * self.recompute.line().per_unit_s
