"""A session's page saves against its fence (DESIGN §12.8).

Pages carry no session: a save names it (AllocateRequest.session_id, PageChunk.session_id) and
the allocation keeps it. Allocate and a stream's page are refused early when the session is not
writable here, but the check that matters is at commit: it runs inside the session's stripe of
SessionOwners.writing, the same lock Migration.Fence writes FREEZING under. So a commit either
publishes entirely before FREEZING (its pages are at the source when the fence returns, and the
last delta copies those of the logged tokens) or is refused after it; never in between. A refused
commit aborts its allocation: its slots freed, its pins dropped, nothing published.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.server.placement import Placement
from kvstore.server.session_owners import SessionOwners


@contextmanager
def committing(owners: SessionOwners, core: Placement, allocation_id: bytes, namespace_id: bytes, session_id: str,
               call: str, owner: str | None = None) -> Iterator[None]:
    """Around the commit of ``allocation_id`` (a save of ``session_id``; empty: no session, no check):
    SessionFenced (counted under ``call``) with the allocation aborted when the session is not
    writable here, else the commit runs with the session's fence held off until it returns."""
    if not session_id:
        yield
        return
    with owners.writing(namespace_id, session_id):
        try:
            owners.check(namespace_id, session_id, call)
        except BaseException:  # fenced, or the node not caught up with etcd: nothing of it stays
            core.abort(allocation_id, owner)
            raise
        yield
