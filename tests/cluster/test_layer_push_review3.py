"""A third adversarial review of the layer-wise handoff pushes (DESIGN §12.7), as pulled over the
data plane (cd398a4, 2e8ca6d, 2641139): PushLayers names the prefill node's allocation and a range,
and the decode node fetches that range of the pages not committed yet (fetch_frames v4, PENDING).
Each test here is a strict xfail for a defect found; it passes once the defect is fixed."""

from __future__ import annotations

import pytest

from kvstore.cluster.page_fetch import start_fetch
from kvstore.errors import InvalidRequest
from kvstore.page_wire.fetch_frames import FetchRequest

NS, KEY = b"\x01" * 16, b"\x02" * 16


@pytest.mark.xfail(strict=True, reason="start_fetch does not check a range against page_bytes: it builds v4 requests "
                                       "its own FetchRequest.decode refuses, so the peer drops the connection (a FAILED "
                                       "fetch, a 'bad frame' warning at the sender) instead of InvalidRequest here")
@pytest.mark.parametrize(("dest", "offset", "page_bytes"), [
    (64, 32, 64),   # offset + length past the page's end
    (64, 0, 32),    # a range longer than the page
    (64, 64, 64),   # a range from the page's end on
])
def test_start_fetch_refuses_a_range_outside_the_page(dest: int, offset: int, page_bytes: int) -> None:
    """``start_fetch``'s contract: with ``offset`` or ``page_bytes``, a range of each ``page_bytes``
    page from ``offset`` on, as long as the destinations, "InvalidRequest otherwise". Whatever it
    builds must be a request the sender accepts: a range it cannot serve is the caller's bug,
    to be raised before anything is sent (as ``check_keys`` and the size check do)."""
    try:
        request, _, _ = start_fetch(1, NS, [KEY], [bytearray(dest)], offset=offset, page_bytes=page_bytes)
    except InvalidRequest:
        return
    FetchRequest.decode(request.encode())  # raises InvalidRequest: the sender would drop the connection
