"""A server's Prometheus metrics as tests read them: one sample's value, over its label sets."""

from __future__ import annotations

import re
import urllib.request


def metric(port: int, name: str) -> float:
    """The sum of ``name``'s samples at the server whose ``--metrics-listen`` is 127.0.0.1:``port``;
    ``name`` may carry labels (``kvstore_rpc_seconds_count{method="Push"}``), matched as written."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(n) for n in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE))
