"""Start-up reconciliation: make the directory agree with what the tiers really hold."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvstore.directory import Directory
from kvstore.errors import KVStoreError
from kvstore.page import LayoutDesc
from kvstore.tiers.base import StoredPage, Tier
from kvstore.tiers.owner_parts import OwnerParts

logger = logging.getLogger(__name__)


def rebuild_directory(directory: Directory, node: str, tiers: list[OwnerParts[Tier]]) -> dict[bytes, LayoutDesc]:
    """This node's locations come from the tiers' own indexes, each part's (what a memory tier held is
    gone; a durable tier holds exactly what it indexed); other nodes' come from the
    directory's LMDB. A page of an older generation than its namespace's (an invalidation
    raised it; a crash kept the page) is deleted, never listed. Returns the layout of every
    namespace found, from one page header each."""
    dropped = 0
    for key in directory.all_keys():
        entry = directory.get(key)
        assert entry is not None
        for loc_node, tier in list(entry.locations):
            if loc_node == node:
                directory.remove(key, loc_node, tier)
                dropped += 1
    layouts: dict[bytes, LayoutDesc] = {}
    recovered = [(part, part.recover()) for tier in tiers for part in tier.parts()]
    for namespace_id, newest in _newest_generations(recovered, directory.generation).items():  # a raise a crash undid
        if newest > directory.generation(namespace_id) and directory.persist_generation(namespace_id, newest):
            directory.enter_generation(namespace_id, newest)
            logger.warning("recovery: namespace %s has pages of generation %d: its generation raised to it",
                           namespace_id.hex(), newest)
    generation = directory.generation
    for tier, pages in recovered:
        records = []
        dead: list[bytes] = []
        damaged: list[bytes] = []
        name = tier.name
        for key, namespace_id, payload_bytes, page_generation in pages:  # one per stored page: kept lean
            if page_generation != generation(namespace_id):
                dead.append(key)
                continue
            if namespace_id not in layouts:
                found = tier.find(key)
                if found is None:  # its index entry fails its check, as every read of it would
                    damaged.append(key)
                    continue
                layouts[namespace_id] = found[1].layout
            records.append((key, namespace_id, name, payload_bytes))
        directory.restore_local(records)
        if records:
            logger.info("recovery: %d %s pages back in the directory", len(records), tier.name)
        if dead:
            _delete_dead(tier, dead)
        _quarantine(tier, damaged)
    if dropped:
        logger.info("recovery: dropped %d stale local locations", dropped)
    return layouts


def _newest_generations(recovered: list[tuple[Tier, list[StoredPage]]], known: Callable[[bytes], int]) -> dict[bytes, int]:
    """The newest generation of each namespace among the recovered pages above ``known``, counted
    only from a page whose header checks: an index entry's generation is read unchecked, and one
    damaged entry trusted would make every other page of its namespace one of an invalidated generation."""
    newest: dict[bytes, int] = {}
    for tier, pages in recovered:
        for key, namespace_id, _, page_generation in pages:
            if page_generation > max(newest.get(namespace_id, 0), known(namespace_id)) and tier.find(key) is not None:
                newest[namespace_id] = page_generation
    return newest


def _delete_dead(tier: Tier, keys: list[bytes]) -> None:
    """Deletes pages of an invalidated generation a crash left in ``tier`` (never listed either way)."""
    try:
        tier.delete(keys)
    except (OSError, KVStoreError) as exc:  # a full index: they stay unlisted, and the tier evicts them in time
        logger.warning("recovery: %d %s pages of invalidated generations could not be deleted (%s); never served",
                       len(keys), tier.name, exc)
        return
    logger.info("recovery: deleted %d %s pages of invalidated generations", len(keys), tier.name)


def _quarantine(tier: Tier, keys: list[bytes]) -> None:
    """Quarantines pages whose index entry failed its check (read for a namespace's layout).
    Never left in the tier unlisted: the core takes a page its tier holds for stored (an
    allocation answers it so, a fetch for a reader skips it), and no read would ever find the
    damage (found by the chaos model, seed 20006: a page promised on another node, never fetched)."""
    for key in keys:
        try:
            tier.quarantine(key, "its index entry failed its check at recovery")
        except (OSError, KVStoreError) as exc:  # a full index: the page stays, taken for stored and never served
            logger.warning("recovery: page %s with a damaged index entry could not be quarantined (%s)", key.hex(), exc)
