"""Random pages with valid headers, for the GPU tests."""

from __future__ import annotations

import numpy as np

from kvstore.page import LayoutDesc, PageHeader, checksum

QWEN3_8B_PAGE = LayoutDesc(36, 2, 8, 128, "bfloat16", 16)  # 2.25 MiB: DESIGN §4's page
NS = b"gpu-checks-ns-00"


def page(i: int, layout: LayoutDesc = QWEN3_8B_PAGE) -> tuple[PageHeader, bytearray]:
    payload = bytearray(np.random.default_rng(i).integers(0, 256, layout.page_bytes, dtype=np.uint8).tobytes())
    return PageHeader(NS, i.to_bytes(16, "big"), layout, layout.page_bytes, checksum(payload)), payload
