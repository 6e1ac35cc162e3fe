"""The crash harness of `kvstore-bench crash` (kvstore.bench.durability.crash), short: random SIGKILLs of
a server under load, then the invariants (durable pages survive and read back exact)."""

from __future__ import annotations

from kvstore.bench.durability.crash import run_iterations


async def test_crash_harness_short(tmp_path) -> None:
    """Three random SIGKILLs under concurrent durable/RAM-only writes and reads. Puts share
    prefixes, durable ones over RAM-only ones too (before, every put had its own token
    range, so the lost durable prefix could not show)."""
    report = await run_iterations(tmp_path / "crash", iterations=3, seed=7)
    assert report["num_violations"] == 0, report["violations"]
    assert report["durable_puts_alive"] > 0 and report["reads_verified"] > 0
    assert report["shared_prefix_puts"] > 0 and report["durable_over_ram"] > 0
