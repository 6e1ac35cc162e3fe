"""What the server's host tier did in one soak phase, from its Stats answers (soak.py).

More: bench/soak/README.md (### soak_tiers.py).
"""

from __future__ import annotations

from typing import Any

HOST = "host"
_COUNTERS = ("evictions", "hits", "misses")


def snapshot(stats: Any) -> dict[str, Any]:
    """The host tier's figures and each tenant's host bytes of one StatsResponse."""
    tier = next((t for t in stats.tiers if t.tier == HOST), None)
    found: dict[str, Any] = {"tenants": {t.tenant: {"host_bytes": int(t.used.get("host_bytes", 0)),
                                                    "host_bytes_quota": int(t.limits.get("host_bytes", 0))}
                                         for t in stats.tenants}}
    if tier is not None:
        found.update(capacity_bytes=tier.capacity_bytes, used_bytes=tier.used_bytes, num_pages=tier.num_pages,
                     **{name: getattr(tier, name) for name in _COUNTERS})
    return found


def window(samples: list[tuple[float, dict[str, Any]]], start_s: float, phase: dict[str, Any]) -> dict[str, Any]:
    """The host tier over the window from the first sample at or after ``start_s`` to the last
    one: its counters' growth there (``*_measured``), their totals, the hit rate in the window,
    the capacity and fill and the tenants' use at the end; and from ``phase`` (soak.py's
    summary): evictions per put or save measured (a side that did more ops evicts more), and
    the share of looked-up tokens the clients found in the window. Empty without samples."""
    if not samples or "capacity_bytes" not in samples[-1][1]:
        return {}
    end = samples[-1][1]
    base = next((s for t, s in samples if t >= start_s), end)
    out: dict[str, Any] = {"capacity_bytes": end["capacity_bytes"], "used_bytes_end": end["used_bytes"],
                           "num_pages_end": end["num_pages"]}
    for name in _COUNTERS:
        out[f"{name}_total"] = end[name]
        out[f"{name}_measured"] = end[name] - base.get(name, 0)
    asked = out["hits_measured"] + out["misses_measured"]
    out["hit_rate_measured"] = round(out["hits_measured"] / asked, 4) if asked else None
    puts = phase["ops"]["put"]["count"] + phase["ops"]["save"]["count"]
    out["evictions_per_put"] = round(out["evictions_measured"] / puts, 3) if puts else None
    c = phase["counts"]
    asked_tokens = c.get("window_tokens_asked", 0)
    out["tokens_found_measured"] = round(c.get("window_tokens_hit", 0) / asked_tokens, 4) if asked_tokens else None
    out["tenants_end"] = end["tenants"]
    return out
