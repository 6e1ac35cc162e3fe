"""An abandoned handoff (HandoffMarkers.abandon, DESIGN §12.7): "for ttl_ms a push still on its way
pins nothing (as once taken over)", also a push served after the abandon. Written by an adversarial
review of 95563ed, where the abandon was remembered only for a marker there was, so when it reached the decode node before the handoff's first Push (the announce, or a push of
pages stored before the open landed: HandoffPushes.open starts both as tasks, the Open answers
before they are sent, and Complete cancels them without waiting when nothing is stored), that
Push, served after it, makes the marker again and pins its pages until the ttl (up to 600 s,
plus the lease margin). The calls below are the decode node's side of that order: the gate's
push() opens the marker and pins what arrived (gate_handoffs.py), after the abandon."""

from __future__ import annotations

import torch
from support.handoffs import leases
from support.kv import random_kv

from kvstore.client import KVStoreClient, new_handoff_id
from kvstore.server.tenancy.gate_handoffs import DEFAULT_TTL_MS


def _tokens(seed: int, pages: int, page_tokens: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (pages * page_tokens,), generator=g).tolist()


async def test_a_push_served_after_the_abandon_pins_nothing(server, ns, layout) -> None:
    tokens = _tokens(71, 4, layout.page_tokens)
    kv = random_kv(layout, len(tokens), seed=71)
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv) == len(tokens)  # the pages the in-flight push copied here
        keys = client.keys(tokens)
        markers, ttl_ms, tenant = server.handoffs, 600_000, "t"
        ident = bytes.fromhex(new_handoff_id())
        # the prefill's Complete with no page: its Push(complete, no keys) is served first ...
        markers.abandon(tenant, ns.namespace_id, ident, ttl_ms)
        # ... then the push it cancelled at the prefill node, already sent (HandoffGate.push)
        marker = markers.open(tenant, ns.namespace_id, ident, ttl_ms)
        markers.arrived(marker, keys, pushed=True)
        assert len(markers) == 0 and await leases(client) == 0, (
            f"a push served after the abandon of its handoff made a marker ({len(markers)}) and pinned "
            f"{len(marker.pinned)} pages under {await leases(client)} lease(s) until the ttl ({ttl_ms / 1000:.0f} s)")


async def test_a_decodes_let_go_is_remembered_for_the_handoffs_own_ttl(server, ns, layout) -> None:
    """A decode that takes nothing more of a handoff lets its node go of it by a Complete that names
    no page there (HandoffGate.complete), which carries no ttl: the node's default (30 s). A handoff
    opened for longer (600 s here) is remembered as abandoned for its own ttl, so a push of it served
    60 s later pins nothing. Before, the default's 30 s were: that push made the marker again and
    pinned its pages until the handoff's ttl."""
    tokens = _tokens(72, 4, layout.page_tokens)
    kv = random_kv(layout, len(tokens), seed=72)
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv) == len(tokens)
        keys = client.keys(tokens)
        markers, ttl_ms, tenant = server.handoffs, 600_000, "t"
        now = [markers.clock()]
        markers.clock = lambda: now[0]
        ident = bytes.fromhex(new_handoff_id())
        markers.arrived(markers.open(tenant, ns.namespace_id, ident, ttl_ms), keys[:1], pushed=True)
        markers.abandon(tenant, ns.namespace_id, ident, DEFAULT_TTL_MS)  # the decode's let-go
        now[0] += 60.0
        marker = markers.open(tenant, ns.namespace_id, ident, ttl_ms)  # a push still on its way
        markers.arrived(marker, keys, pushed=True)
        assert len(markers) == 0 and await leases(client) == 0, (
            f"a push served 60 s after the decode let go of its handoff pinned {len(marker.pinned)} pages "
            f"until the handoff's ttl ({ttl_ms / 1000:.0f} s)")
