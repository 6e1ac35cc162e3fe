"""Start-up reconciliation: make the directory agree with what the tiers really hold."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.server.placement import TierManager

logger = logging.getLogger(__name__)


def rebuild_directory(m: TierManager) -> None:
    """This node's locations come from the tiers' own indexes (RAM pages are gone; SSD
    pages are exactly the indexed ones); other nodes' come from the directory's LMDB."""
    dropped = 0
    for key in m.directory.all_keys():
        entry = m.directory.get(key)
        assert entry is not None
        for node, tier in list(entry.locations):
            if node == m.node:
                m.directory.remove(key, node, tier)
                dropped += 1
    if m.ssd is not None:
        ssd = m.ssd
        records = []
        for key, namespace_id, payload_bytes in ssd.recovered:
            if namespace_id not in m._layouts:
                header = ssd.header(key)
                if header is None:
                    continue  # corrupt index header: found and quarantined on first read
                m._layouts[namespace_id] = header.layout
            records.append((key, namespace_id, "ssd", payload_bytes))
        m._ssd_lru = OrderedDict.fromkeys(r[0] for r in records)
        ssd.recovered = []
        m.directory.restore_local(records)
        logger.info("recovery: %d ssd pages back in the directory", len(records))
    if dropped:
        logger.info("recovery: dropped %d stale local locations", dropped)
