"""A UCX page server asked to VERIFY finds a page damaged mid-answer, then its wait for the sends
before it is cut (its send timeout, its server closed): the page is still quarantined, while pinned,
and every page released once, none while a send reads it (DESIGN §12.3).

Bug pinned here: ``UcxPageServer._serve`` reported a damaged page to its tier only after the sends
before it had ended; a cut during that wait skipped the report, and the page stayed served.

Real server and fetcher, UCX over loopback; the sends before the damaged page report their end only
once the test lets them (test_ucx_send_cancel's endpoint stand-in)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from test_ucx_send_cancel import PAGES, WAIT_S, HeldSource, answering

from kvstore.cluster import transport_ucx
from kvstore.cluster.transport_ucx import SourcePage

BAD = 4  # the damaged page: the sends of the pages before it are posted, held
ABORT_WAIT_S = 0.5
TIMEOUT_S = 1.0


class DamagedSource(HeldSource):
    """``HeldSource`` whose page ``BAD`` no longer matches its checksum; notes its reports."""

    def __init__(self) -> None:
        super().__init__()
        self.reports: list[int] = []  # per report: the page's releases before it (0: reported while pinned)

    async def open_pages(self, namespace_id: bytes, keys: Sequence[bytes], generation: int = 0) -> list[SourcePage | None]:
        pages = await super().open_pages(namespace_id, keys, generation)
        bad = pages[BAD]
        assert bad is not None
        pages[BAD] = SourcePage(bad.data, bad.checksum ^ 1, bad.release, damaged=self._damaged)
        return pages

    def _damaged(self, reason: str) -> None:
        self.reports.append(self.releases[BAD])


@pytest.mark.parametrize("cut", ["none", "timed-out", "closed"])
async def test_a_damaged_page_is_reported_also_when_the_answer_is_cut(monkeypatch: pytest.MonkeyPatch, cut: str) -> None:
    monkeypatch.setattr(transport_ucx, "_ABORT_WAIT_S", ABORT_WAIT_S)
    source = DamagedSource()
    async with answering(source, TIMEOUT_S if cut == "timed-out" else WAIT_S, True) as server:
        try:
            async with asyncio.timeout(WAIT_S):
                while len(server.sends) < BAD and not server.ended.is_set():
                    await asyncio.sleep(0.01)
            async with asyncio.timeout(WAIT_S):  # its check ends and it is reported before the sends before it end
                while not source.reports:
                    await asyncio.sleep(0.01)
            assert len(server.sends) == BAD, f"{len(server.sends)} pages sent, the {BAD} before the damaged one expected"
            if cut == "closed":
                server.close_now()
            if cut != "none":
                await asyncio.wait_for(server.aborted.wait(), WAIT_S)
                await asyncio.wait_for(server.ended.wait(), WAIT_S)  # cut, and its abort's wait over
            assert not source.early, f"pages {source.early} were released while a send reading them was still posted"
        finally:
            server.gate.set()
        await asyncio.wait_for(source.all_released.wait(), WAIT_S)
        await asyncio.wait_for(server.ended.wait(), WAIT_S)
        assert source.reports == [0], f"the damaged page's reports (its releases before each): {source.reports}"
        assert not source.early, f"pages {source.early} were released while a send reading them was still posted"
        assert source.releases == [1] * PAGES, f"pages released other than once each: {source.releases}"
