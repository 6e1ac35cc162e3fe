"""Disaggregated prefill, the decode instance's receives (a mixin of pd_worker.py's
HandoffWorker, apart because they are half of it): the marker waited for and the pages leased
or got in the background, copied into the request's blocks between steps (DESIGN §12.7).

More: client/adapters/vllm/README.md (### pd_receives.py, ### pd_worker.py).
"""

from __future__ import annotations

import logging
import time

import torch

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.layout import RequestKV
from kvstore.client.adapters.vllm.metadata import HandoffLoad
from kvstore.client.adapters.vllm.pd_jobs import HandoffStats, Receiving, let_go
from kvstore.client.adapters.vllm.pd_leases import arena_of, copy_into, give_back, take
from kvstore.client.client import Hit, KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.types import KVLayout

logger = logging.getLogger(__name__)

GRACE_S = 5.0  # past its deadline, how long a receive's get may still run before it is given up on


class ReceiveSide:
    """Needs these of the HandoffWorker it is mixed into."""

    store: StoreConnection
    layout: KVLayout
    blocks: list[torch.Tensor]
    all_layers: torch.Tensor | None
    stats: HandoffStats
    _receiving: list[Receiving]
    _failed_blocks: set[int]
    _short: dict[str, int]

    def _failed(self, client: KVStoreClient | None, exc: BaseException | None) -> None:
        """A transport failure drops the client (the next call connects anew: a restarted node is
        found again); an error the store answered with keeps it (StoreConnection.failed)."""
        if client is not None and exc is not None:
            self.store.failed(client, exc)

    def _receive(self, client: KVStoreClient | None, spec: HandoffLoad) -> Receiving:
        start_by = time.monotonic() + spec.deadline_s
        rec = Receiving(spec, None, start_by, start_by + GRACE_S, None)
        self._start(rec, client, spec.deadline_s)
        return rec

    def _start(self, rec: Receiving, client: KVStoreClient | None, deadline_s: float) -> None:
        if client is not None:
            rec.client, rec.job = client, client.runtime.submit(self._fetch(client, rec.spec, rec, deadline_s))

    async def _fetch(self, client: KVStoreClient, spec: HandoffLoad, rec: Receiving, deadline_s: float) -> int:
        """Waits for the handoff's marker, then leases every page it answered (also those
        vLLM's own cache holds: the marker keeps what it answered until acquired) into
        ``rec.taken``, or without an arena gets them into ``rec.staging``; returns how many
        leading pages of the load are there. Unless it took every page the wait answered (the
        node then let go of the handoff: HandoffMarkers.acquired), it lets go once it ended
        however it ended (short, failed, cancelled): ``let_go``."""
        taken_all = False
        try:
            hit = await client.handoff_wait(spec.handoff_id, spec.tokens, deadline_s)
            n = min(hit.num_pages, spec.first_page + spec.num_pages)
            if n <= 0:
                return 0
            transport = arena_of(client)
            if transport is not None:
                rec.taken = await take(client, transport, hit.keys[:n])
                taken_all = rec.taken.num_pages == hit.num_pages
                return max(0, rec.taken.num_pages - spec.first_page)
            lay, p = self.layout, self.layout.page_tokens
            rec.staging = torch.empty((lay.num_layers, lay.kv_factor, n * p, lay.num_kv_heads, lay.head_dim),
                                      dtype=lay.torch_dtype())
            try:
                await client.get(Hit(hit.namespace_id, n * p, hit.keys[:n], [], hit.generation), rec.staging)
                taken_all = n == hit.num_pages
            except KVStoreError as exc:  # PageMissing, PageCorrupt: the leading pages before it are in place
                n = int(getattr(exc, "num_tokens", 0)) // p
            return max(0, n - spec.first_page)
        finally:
            if not taken_all:
                let_go(client, spec.handoff_id)

    def _settle_receives(self, now: float, gone: set[str]) -> set[str]:
        """Receives that ended, landed. ``gone``: requests vLLM finished (aborted while they wait):
        reported now, nothing landed (vLLM frees their blocks then), their leases given back."""
        recving: set[str] = set()
        still = []
        for rec in self._receiving:
            if rec.spec.req_id in gone:
                if rec.job is not None and not rec.job.result.done():
                    rec.job.cancel()
                if rec.job is not None:  # once it ends: a lease it took is given back
                    rec.job.result.add_done_callback(lambda _, rec=rec: self._give_back(rec, []))
                recving.add(rec.spec.req_id)
                continue
            if rec.job is None and now < rec.start_by:  # a store reconnecting (a node restarted) may still answer in time
                self._start(rec, self.store.client(), rec.start_by - now)
            if (rec.job is None and now < rec.start_by) or (rec.job is not None and not rec.job.result.done()
                                                             and now <= rec.give_up_at):
                still.append(rec)
                continue
            self._land(rec)
            recving.add(rec.spec.req_id)
        self._receiving = still
        return recving

    def _land(self, rec: Receiving) -> None:
        """Copies a receive's pages into the request's blocks; the rest are failed blocks."""
        spec, p = rec.spec, self.layout.page_tokens
        valid, reason = 0, "the store could not be reached"
        if rec.job is not None and not rec.job.result.done():
            rec.job.cancel()  # it writes only into its lease or staging, and gives back a lease it took once it ends
            rec.job.result.add_done_callback(lambda _: self._give_back(rec, []))
            reason = f"no marker or pages within {spec.deadline_s:.1f} s (+{GRACE_S:.0f} s)"
        elif rec.job is not None and rec.job.result.exception() is not None:
            reason = str(rec.job.result.exception())
            self._failed(rec.client, rec.job.result.exception())
        elif rec.job is not None:
            valid, reason = int(rec.job.result.result()), "the handoff held fewer pages (missing, foreign or expired)"
            try:
                valid, reason = self._copy(rec, valid, reason)
            finally:
                self._give_back(rec, [])
        if valid == spec.num_pages:
            self.stats.received += 1
            self.stats.received_tokens += valid * p
            return
        first_token, end_token = (spec.first_page + valid) * p, (spec.first_page + spec.num_pages) * p
        blocks = spec.block_ids[first_token // self.block_size : -(-end_token // self.block_size)]
        self._failed_blocks.update(blocks)
        self._short[spec.req_id] = spec.first_page + valid
        self.stats.receive_failed += 1
        self.stats.failed_blocks += len(blocks)
        logger.warning("kvstore handoff %s of request %s: %d of %d pages received (%s); vLLM recomputes %d blocks",
                       spec.handoff_id, spec.req_id, valid, spec.num_pages, reason, len(blocks))

    def _copy(self, rec: Receiving, valid: int, reason: str) -> tuple[int, str]:
        """Copies the ``valid`` leading pages of a receive into the request's blocks: from its
        lease (checksums verified: a page that fails ends the prefix, and is reported with the
        release), else from its staging tensor; returns the pages in place and why fewer."""
        spec, p = rec.spec, self.layout.page_tokens
        kv = RequestKV(self.blocks, spec.block_ids, spec.first_page, spec.num_pages, self.layout, all_layers=self.all_layers)
        if rec.taken is not None:
            copied, bad = copy_into(rec.taken, kv, spec.first_page, valid, self.layout)
            self._give_back(rec, bad)
            self.stats.received_leased += 1
            if bad:
                logger.error("handed-off page %d of request %s failed its checksum", spec.first_page + copied, spec.req_id)
                return copied, "a page failed its checksum"
            return copied, reason if copied == valid else "the lease ran out before the copy"
        if rec.staging is not None:
            for i in range(valid):
                kv.write_page(i, rec.staging[:, :, (spec.first_page + i) * p : (spec.first_page + i + 1) * p])
        return valid, reason

    def _give_back(self, rec: Receiving, failed: list[bytes]) -> None:
        """Releases what the receive leased (once: later calls find it given back). A client the
        connection dropped and closed meanwhile gives it back through the store's client of now:
        after a restart, its channel may have taken the lease at the server that answers now (a
        lease of the server gone went with it: released there, it is refused, and logged)."""
        if rec.taken is None or rec.client is None:
            return
        client: KVStoreClient | None = rec.client
        try:
            transport = arena_of(rec.client)
        except KVStoreError:  # closed
            client = self.store.client()
            transport = arena_of(client) if client is not None else None
        give_back(client or rec.client, transport, rec.taken, failed)

    def load_errors(self) -> set[int]:
        errors, self._failed_blocks = self._failed_blocks, set()
        return errors

    def take_short(self) -> dict[str, int]:
        """Decode requests whose receive came short, with the leading pages they hold: their
        saves start there (the scheduler side had counted the whole handoff as stored)."""
        short, self._short = self._short, {}
        return short
