"""Pages a reader reports failing their checksum in the arena: checked here, quarantined if
they do fail.

A same-host client verifies every page it copies out of its arena. A page that fails there
had its slot's bytes changed after they were stored (a bug, bad memory, a writer of the
tenant scribbling on a slot it no longer holds). Unreported, it would stay listed: every
later lookup would promise it and every get fail on it, a miss disguised as a hit for as
long as the page stays. The server checks the bytes itself instead of trusting the report,
so a client cannot get a good page quarantined, and looks only at keys of the caller's own
lease, which still pins them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.errors import PageCorrupt
from kvstore.pagecopy import checksum_released

if TYPE_CHECKING:
    from kvstore.server.placement.core import Placement

MAX_REPORTED = 64  # keys a Release may report: one batch of a get
REASON = "its bytes in the arena do not match its checksum (reported by a reader)"


def check_reported(core: Placement, lease_id: bytes, tenant: str | None, keys: list[bytes]) -> int:
    """Verifies the landing copies of ``keys`` held by the lease ``lease_id`` (of ``tenant``,
    when given); quarantines those that fail. Returns how many did. Call before the release."""
    with core.keeper.critical():
        leased = core.leases.keys_of(lease_id, tenant)
        wanted = set(keys) & set(leased or ())
        pages = [(core.landing.slot_of(key), core.landing.header(key)) for key in wanted]
    failed = 0
    for slot, header in pages:
        if slot is None or header is None:
            continue
        try:  # the lease pins the page: its slot holds it while this runs
            header.verify_payload(core.landing.view(slot, header.payload_bytes), header.payload_bytes, checksum_released)
        except PageCorrupt:
            core.moves.quarantine_landing(header, REASON, slot)
            failed += 1
    return failed
