"""What may be written to the SSD tier: a write budget from the drive's endurance, and
admission by value; ``AdmittedTier`` puts both around a tier.

An SSD rated DWPD drive-writes a day accepts ``capacity × DWPD / 86,400`` bytes/s in the
long run (3.84 TB at 1 DWPD: 44.4 MB/s), while one GPU can produce KV at over 1 GB/s. The
``WriteBudget`` is a token bucket over bytes with a bounded burst; every SSD write takes
from it and a write it cannot cover is refused. Policies answer ``can_admit`` without side
effects on eviction state; they learn from ``record_access`` and ``record_refused``.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvstore.errors import ConfigError
from kvstore.page import FLAG_SESSION_OPEN, FLAG_WANTED, PageHeader
from kvstore.planner import SECONDS_PER_DAY, ssd_write_budget_bps
from kvstore.server.metrics import Metrics
from kvstore.tiers.base import Tier, TierWrapper

WARRANTY_DAYS = 5 * 365


class WriteBudget:
    """Token bucket over the bytes that reach the device: ``rate_bps`` long-run, at most
    ``burst_bytes`` at once. A rate of 0 means no budget (unlimited writes, still counted).

    A page write ``take``s its bytes up front (header + padded payload); writes whose size is
    known only afterwards (index transactions) come from ``settle``, which returns the bytes
    written since it was last called, and are charged at each refill, into debt if need be."""

    def __init__(self, rate_bps: float, burst_bytes: float, clock: Callable[[], float],
                 settle: Callable[[], int] | None = None) -> None:
        if rate_bps < 0 or burst_bytes < 0:
            raise ConfigError("--ssd-dwpd and the burst must be >= 0")
        self.rate_bps = rate_bps
        self.burst_bytes = burst_bytes
        self.clock = clock
        self.tokens = burst_bytes
        self._last = clock()
        self.written_bytes = 0
        self.refused_bytes = 0
        self._started = self._last
        self._settle = settle

    @classmethod
    def for_drive(cls, capacity_bytes: int, dwpd: float, clock: Callable[[], float], burst_s: float = 60.0,
                  settle: Callable[[], int] | None = None) -> WriteBudget:
        rate = ssd_write_budget_bps(capacity_bytes, dwpd)
        burst = max(rate * burst_s, 16 << 20) if rate else 0.0
        return cls(rate, burst, clock, settle)

    @property
    def unlimited(self) -> bool:
        return self.rate_bps == 0

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst_bytes, self.tokens + (now - self._last) * self.rate_bps)
        self._last = now
        if self._settle is not None:
            spent = self._settle()
            self.written_bytes += spent
            if not self.unlimited:
                self.tokens -= spent

    def fill(self) -> float:
        """Fraction of the burst available now (1.0 when unlimited)."""
        self._refill()
        if self.unlimited:
            return 1.0
        return self.tokens / self.burst_bytes if self.burst_bytes else 0.0

    def can_take(self, num_bytes: int) -> bool:
        self._refill()
        return self.unlimited or self.tokens >= num_bytes

    def take(self, num_bytes: int) -> bool:
        """Takes ``num_bytes`` if the bucket holds them; False (nothing taken) otherwise."""
        if not self.can_take(num_bytes):
            self.refused_bytes += num_bytes
            return False
        if not self.unlimited:
            self.tokens -= num_bytes
        self.written_bytes += num_bytes
        return True

    def write_rate_bps(self) -> float:
        self._refill()
        elapsed = self.clock() - self._started
        return self.written_bytes / elapsed if elapsed > 0 else 0.0

    def projected_life_days(self, capacity_bytes: int, dwpd: float) -> float:
        """Days until the rated endurance (capacity × DWPD × 5 years) is used at the
        average write rate so far."""
        rate = self.write_rate_bps()
        endurance = capacity_bytes * dwpd * WARRANTY_DAYS
        return math.inf if rate <= 0 or dwpd <= 0 else endurance / rate / SECONDS_PER_DAY


class FrequencySketch:
    """Count-min sketch of accesses with aging: every ``window`` recorded accesses all
    counters halve, so old popularity fades (as in TinyLFU)."""

    def __init__(self, width: int = 1 << 16, depth: int = 4, window: int = 1 << 18) -> None:
        self.width, self.depth, self.window = width, depth, window
        self.table = np.zeros((depth, width), dtype=np.uint32)
        self.seen = 0

    def _slots(self, key: bytes) -> list[int]:
        digest = hashlib.blake2b(key, digest_size=4 * self.depth).digest()
        return [int.from_bytes(digest[4 * i : 4 * i + 4], "little") % self.width for i in range(self.depth)]

    def add(self, key: bytes) -> None:
        for row, col in enumerate(self._slots(key)):
            self.table[row, col] += 1
        self.seen += 1
        if self.seen >= self.window:
            self.table >>= 1
            self.seen = 0

    def estimate(self, key: bytes) -> int:
        return int(min(self.table[row, col] for row, col in enumerate(self._slots(key))))


class GhostList:
    """Keys recently evicted without admission: seeing one again proves reuse beyond the
    host tier's reach."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys


@dataclass(frozen=True)
class Decision:
    admit: bool
    reason: str


class AdmissionPolicy(Protocol):
    name: str

    def can_admit(self, key: bytes, flags: int, budget: WriteBudget, num_bytes: int) -> Decision:
        """Whether a page leaving the host tier should be written to SSD. No side effects."""
        ...

    def record_access(self, key: bytes) -> None: ...

    def record_refused(self, key: bytes) -> None: ...


class _Learning:
    def __init__(self) -> None:
        self.sketch = FrequencySketch()
        self.ghosts = GhostList()

    def record_access(self, key: bytes) -> None:
        self.sketch.add(key)

    def record_refused(self, key: bytes) -> None:
        self.ghosts.add(key)


class AdmitAll(_Learning):
    """Everything the budget allows, first come first served."""

    name = "all"

    def can_admit(self, key: bytes, flags: int, budget: WriteBudget, num_bytes: int) -> Decision:
        if not budget.can_take(num_bytes):
            return Decision(False, "budget")
        return Decision(True, "any")


class SeenTwice(_Learning):
    """Pages accessed at least twice, within the budget."""

    name = "seen-twice"

    def can_admit(self, key: bytes, flags: int, budget: WriteBudget, num_bytes: int) -> Decision:
        if self.sketch.estimate(key) < 2:
            return Decision(False, "one-shot")
        if not budget.can_take(num_bytes):
            return Decision(False, "budget")
        return Decision(True, "reused")


class ValueAdmission(_Learning):
    """Admits by value: engine-marked pages (wanted, open session) first; then pages whose
    reuse beyond the host tier's reach is proven: evicted once without admission and asked
    for again (a ghost seen twice). Any other page only with tokens that would otherwise
    overflow unused. Scarce writes go to proven prefixes instead of to whoever comes
    first, and no budget is wasted.

    A page used twice while still in RAM has shown reuse the host tier serves, not reuse
    the SSD is for: on the Mooncake trace such pages, written, brought 1.6 SSD hits each
    against 3.2 for ghosts, so they wait like one-shot pages (until they come back as
    ghosts, or the bucket is about to overflow)."""

    name = "value"

    def __init__(self, reserve: float = 0.0, overflow_fill: float = 0.99) -> None:
        super().__init__()
        self.overflow_fill = overflow_fill  # bucket fill from which any page may have the spare tokens
        self.reserve = reserve  # share of the burst kept for engine-marked pages

    def can_admit(self, key: bytes, flags: int, budget: WriteBudget, num_bytes: int) -> Decision:
        if flags & FLAG_WANTED:
            reason = "wanted"
        elif flags & FLAG_SESSION_OPEN:
            reason = "session"
        else:
            count = self.sketch.estimate(key)
            if key in self.ghosts and count >= 2:
                reason = "ghost"
            elif budget.fill() >= self.overflow_fill:
                reason = "spare-budget"
            else:
                return Decision(False, "one-shot" if count < 2 else "reused-in-ram")
            if not budget.unlimited and budget.fill() < self.reserve:
                return Decision(False, "budget")
        if not budget.can_take(num_bytes):
            return Decision(False, "budget")
        return Decision(True, reason)


POLICIES: dict[str, type] = {"all": AdmitAll, "first-come": AdmitAll, "seen-twice": SeenTwice, "value": ValueAdmission}


def make_policy(name: str) -> AdmissionPolicy:
    try:
        return POLICIES[name]()  # type: ignore[no-any-return]
    except KeyError:
        raise ConfigError(f"--ssd-admission must be one of {', '.join(POLICIES)}, got {name!r}") from None


class AdmittedTier(TierWrapper):
    """A demotion target whose writes pass an admission policy and a write budget.

    ``admit`` decides whether a page leaving a faster tier is worth a write here (policy and
    budget, counted in the metrics; a refused page is remembered by the policy); ``charge``
    takes a write's device bytes from the budget. Everything else is the inner tier's.
    Called under the placement core's lock (the budget and the policy are not thread-safe).
    """

    def __init__(self, inner: Tier, policy: AdmissionPolicy, budget: WriteBudget, metrics: Metrics,
                 write_cost: Callable[[int], int], capacity_bytes: int, dwpd: float) -> None:
        super().__init__(inner)
        self.policy = policy
        self.budget = budget
        self.metrics = metrics
        self.write_cost = write_cost  # device bytes of one page write, from its payload bytes
        self.capacity_bytes = capacity_bytes
        self.dwpd = dwpd

    def learn(self, key: bytes) -> None:
        """A use of ``key`` (admission learns what is reused)."""
        self.policy.record_access(key)

    def admit(self, header: PageHeader) -> bool:
        cost = self.write_cost(header.payload_bytes)
        decision = self.policy.can_admit(header.key, header.flags, self.budget, cost)
        self.metrics.admissions.labels(self.policy.name, "admit" if decision.admit else "refuse", decision.reason).inc()
        if not decision.admit:
            self.policy.record_refused(header.key)
            self.metrics.ssd_refused_bytes.inc(cost)
        return decision.admit

    def charge(self, payload_bytes: int) -> bool:
        """Takes one page write from the budget; False (counted as refused) when it is spent."""
        cost = self.write_cost(payload_bytes)
        if self.budget.take(cost):
            return True
        self.metrics.ssd_refused_bytes.inc(cost)
        return False

    def life_days(self) -> float:
        """Projected drive life at the write rate so far (-1: unbounded)."""
        life = self.budget.projected_life_days(self.capacity_bytes, self.dwpd)
        return life if life != math.inf else -1.0

    def report(self) -> dict[str, float]:
        """Budget and admission figures for the Stats RPC (and the gauges)."""
        self.metrics.ssd_budget_fill.set(self.budget.fill())
        self.metrics.ssd_write_rate.set(self.budget.write_rate_bps())
        self.metrics.ssd_life_days.set(self.life_days())
        figures = {
            "dwpd": self.dwpd,
            "budget_bytes_per_s": self.budget.rate_bps,
            "budget_fill": self.budget.fill(),
            "written_bytes": float(self.budget.written_bytes),
            "refused_bytes": float(self.metrics.ssd_refused_bytes._value.get()),
            "write_rate_bytes_per_s": self.budget.write_rate_bps(),
            "projected_life_days": self.life_days(),
        }
        for metric in self.metrics.admissions.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    figures[f"admission.{sample.labels['decision']}.{sample.labels['reason']}"] = sample.value
        return figures
