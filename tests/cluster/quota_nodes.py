"""Cluster nodes with tenants where tenant a has a small host quota at the last node: the
setup of the quota tests (handoffs and fills that the reader's own room cuts short)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support.certs import CertAuthority
from test_cluster_auth import secure_args
from test_cluster_nodes import LAYOUT

NODE_TOKEN = "cluster-node-token-0123456789ab"
PAGE_BYTES = LAYOUT.num_layers * 2 * LAYOUT.page_tokens * LAYOUT.num_kv_heads * LAYOUT.head_dim * 2  # float16


def quota_nodes(cluster_nodes: Any, tmp_path: Path, monkeypatch: Any, names: list[str], quota_pages: int,
                *extra: str) -> list[Any]:
    """``names`` started on the tcp plane with tenants (``extra``: flags for every node); tenant a
    may hold ``quota_pages`` pages in the host tier of the last of them."""
    monkeypatch.setenv("KVSTORE_CLUSTER_TOKEN", NODE_TOKEN)
    args = secure_args(tmp_path, CertAuthority(tmp_path / "ca"), names, NODE_TOKEN)
    last = names[-1]
    auth = json.loads(Path(args[last][1]).read_text())
    auth["quotas"] = {"a": {"host_bytes": quota_pages * PAGE_BYTES}}
    limited = tmp_path / f"auth-{last}.json"
    limited.write_text(json.dumps(auth))
    limited.chmod(0o600)
    each = {name: args[name][:2] for name in names[:-1]} | {last: ["--auth-file", str(limited)]}
    return cluster_nodes(names, "tcp", *extra, each=each)
