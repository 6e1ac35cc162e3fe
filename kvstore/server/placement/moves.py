"""Moving pages between tiers without holding the core's lock over I/O.

Every move has the same shape: decide under the lock (victim, slot, budget), let go of it
for the I/O (pwrite, fdatasync, the index commit, a delete, a read), take it again to
publish. What a move touches is pinned meanwhile, so that it is neither evicted, freed nor
written twice; a page removed meanwhile is not published (``Directory.publish_listed``).

More: kvstore/server/placement/README.md (### moves.py); DESIGN §4.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container
from concurrent.futures import ThreadPoolExecutor

from kvstore.directory import Directory
from kvstore.errors import LimitExceeded, MetadataFull, PageCorrupt, TierFull, TierUnavailable
from kvstore.page import PageHeader
from kvstore.pagecopy import checksum_released
from kvstore.server.admission import AdmittedTier
from kvstore.server.leases import LeaseTable
from kvstore.server.metrics import Metrics
from kvstore.server.placement.background import is_behind, lift, name_thread, run_behind, write_pieces
from kvstore.server.placement.lower_room import LowerRoom
from kvstore.server.placement.residence import LANDING, Residence
from kvstore.server.placement.shares import NamespaceShares
from kvstore.server.placement.unchecked import UncheckedCopies
from kvstore.tiers.base import LandingPart, ReadResult

logger = logging.getLogger(__name__)

DEMOTE_PAGES = 64  # a demoter round writes at most this many pages down ...
DEMOTE_BYTES = 32 << 20  # ... and about this many bytes: one sync and one index commit for them all
BACKOFF_S = (0.5, 30.0)  # after a round the lower tier failed, the next waits this long, doubling up to the second
DOOMED_WAIT_S = 10.0  # a durable write waits this long at most for an older copy's delete


def _damages(pages: list[tuple[PageHeader, memoryview]]) -> list[str | None]:
    """Why each payload is not the page its header describes (None when it is); hashed with
    the GIL released, beside the disk writes, so that lookups do not wait for it."""
    out: list[str | None] = []
    for header, payload in pages:
        try:
            header.verify_payload(payload, len(payload), checksum_released)
            out.append(None)
        except PageCorrupt as exc:
            out.append(str(exc))
    return out


class Mover(LowerRoom):
    def __init__(self, lock: threading.Lock, residence: Residence, lower: list[AdmittedTier], leases: LeaseTable,
                 directory: Directory, node: str, metrics: Metrics, settle_owed: Callable[[], None] = lambda: None,
                 shares: NamespaceShares | None = None) -> None:
        self.lock = lock
        self._settle_owed = settle_owed  # lock held: does the owed removals now (lets go of the lock meanwhile)
        self.residence = residence
        self.landing = residence.landing
        self.lower = lower  # residence.tiers[1:], with their admission
        self.leases = leases
        self.directory = directory
        self.node = node
        self.metrics = metrics
        self._writing: set[tuple[bytes, int]] = set()  # (key, tier) being written down
        self._written = threading.Condition(lock)
        # checks beside disk writes: the foreground's (its worker started here, by a foreground thread: one
        # the idle demoter started would inherit its class) and the idle demoter's (background.py)
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-verify", initializer=name_thread,
                                            initargs=("kv-verify",))
        self._verifier.submit(int).result()
        self._behind_tids: list[int] = []  # its worker's, lifted at close (background.lift)
        self._behind_verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-verify-behind",
                                                   initializer=self._start_behind)
        self.starved = threading.Event()  # set when an allocation found no room and evicted inline: the demoter lags
        self._last_error_log = 0.0
        self.shares = shares  # the ssd shares pages count against by namespace (none: no shares)
        self.unchecked = UncheckedCopies()  # landed from other nodes unhashed: a damaged one's source checks its own
        self.clock: Callable[[], float] = time.monotonic  # the demoter's backoff (tests replace it)
        self._backoff_s = 0.0  # after a failed round: how long the demoter waits, until ``_retry_at``
        self._retry_at = 0.0

    def _start_behind(self) -> None:
        self._behind_tids.append(threading.get_native_id())
        name_thread("kv-verify-bg")
        run_behind("idle", 0)

    def close(self) -> None:
        self._verifier.shutdown(wait=True)
        for tid in self._behind_tids:
            lift(tid)  # the checks still queued run at disk speed, not on spare CPU
        self._behind_verifier.shutdown(wait=True)

    # -- landing room (lock held; released around writes) --------------------------------

    def make_room(self, page_bytes: int, arena: LandingPart) -> int | None:
        """A slot in ``arena`` (a part of the landing tier: one owner's arena) for a page of
        ``page_bytes``, evicting from that arena as needed; None when every page left in it
        is pinned. Called with the lock held; lets go of it while a victim is written down,
        so what the caller decided before may have changed after."""
        while True:
            slot = arena.reserve(page_bytes)
            if slot is not None:
                return slot
            if self.lower:
                self.starved.set()  # the demoter's urgent half writes down ahead of the next ones
            if not self.evict_one(page_bytes, None, arena):
                return None

    def evict_one(self, page_bytes: int, skip: Container[bytes] | None = None, arena: LandingPart | None = None) -> bool:
        """Evicts the next victim of ``arena`` (default: the landing tier's choice), written
        down first when it is worth it, passing over the keys in ``skip`` (default: the
        pinned ones); False when there is none. Lock held; released during the write."""
        return self.evict_some(page_bytes, skip, arena) > 0

    def demote(self, arena: LandingPart, low: float) -> bool:
        """Lock held: evicts ``arena``'s coldest pages toward ``low`` of its capacity, the ones
        worth it written down as one batch (the demoter's round); False when nothing could go,
        or while it backs off after a round the lower tier failed (whose pages stayed in RAM)."""
        if self.clock() < self._retry_at:
            return False
        usage = arena.usage()
        over = usage.used_bytes - int(low * usage.capacity_bytes)
        return self.evict_some(0, None, arena, DEMOTE_PAGES, min(over, DEMOTE_BYTES), keep=True) > 0

    def evict_some(self, page_bytes: int, skip: Container[bytes] | None = None, arena: LandingPart | None = None,
                   limit: int = 1, max_bytes: int = 0, keep: bool = False) -> int:
        """``evict_one`` for up to ``limit`` victims (no more once ``max_bytes`` of them are
        picked, when given); the ones worth writing down go in one ``write_down``: one sync
        and one index transaction for all of them. Returns how many victims it found.
        ``keep`` (work ahead of need): what an I/O error left unwritten stays in RAM."""
        found, picked = 0, 0
        batch: list[tuple[bytes, PageHeader, memoryview]] = []
        parts: dict[bytes, LandingPart] = {}  # each victim's arena
        while found < limit and (max_bytes <= 0 or picked < max_bytes):
            named = self.residence.landing_orders.victim(self.landing.parts() if arena is None else [arena],
                                                         self.leases.kept if skip is None else skip, page_bytes)  # the batch's skipped
            if named is None:
                break
            part, victim = named
            held = part.find(victim)
            assert held is not None
            slot, header = held
            found, picked = found + 1, picked + header.payload_bytes
            if not self.lower or self.residence.has(victim, 1) or not self._target(1).admit(header):
                self._evict(part, [victim])
                continue
            self.leases.pin([victim], move=True)
            parts[victim] = part
            batch.append((victim, header, part.view(slot, header.payload_bytes)))
        if batch:
            self._write_victims(batch, parts, keep)
        return found

    def _write_victims(self, batch: list[tuple[bytes, PageHeader, memoryview]], parts: dict[bytes, LandingPart],
                       keep: bool = False) -> None:
        """Lock held (released for the write): writes pinned victims down, then evicts them
        from the landing tier. A batch with a damaged page (quarantined, nothing indexed)
        leaves the others in place for the next round; so does an I/O error with ``keep``
        (the demoter's round, which then backs off); else (an allocation needs the room) or
        after a refusal they leave the cache as any eviction."""
        keys = [key for key, _, _ in batch]
        kept = True  # whether what was not written down may be dropped
        self.lock.release()
        try:
            self.write_down(1, [(header, view) for _, header, view in batch])
            self._backoff_s = 0.0
        except PageCorrupt:
            kept = False
        except (OSError, MetadataFull):  # logged and counted by write_down
            kept = not keep
            if keep:
                self._backoff_s = min(max(2 * self._backoff_s, BACKOFF_S[0]), BACKOFF_S[1])
                self._retry_at = self.clock() + self._backoff_s
        finally:
            self.lock.acquire()
            self.residence.released(self.leases.unpin(keys, move=True))
        has, pinned = self.residence.has, self.leases.pinned
        below = [key for key in keys if has(key, 1)]
        if below:
            self.metrics.demotions.labels(self.landing.name).inc(len(below))
        # a reader that took one meanwhile keeps it (now clean) in place
        going = [key for key in (keys if kept else below) if has(key, LANDING) and not pinned(key)]
        for part in {id(part): part for part in parts.values()}.values():  # an arena's at once
            self._evict(part, [key for key in going if parts[key] is part])

    def _evict(self, arena: LandingPart, keys: list[bytes]) -> None:
        """Drops landing pages of ``arena`` (a round's at once: one delete, the counter once)."""
        if not keys:
            return
        arena.delete(keys, evicted=True)
        for key in keys:
            self.directory.remove(key, self.node, self.landing.name)
        self.metrics.evictions.labels(self.landing.name).inc(len(keys))

    # -- writing down (lock not held) ----------------------------------------------------

    def write_through(self, keys: list[bytes]) -> None:
        """Copies landing pages (pinned by the caller) to the first lower tier, synced: a
        durable commit. Raises TierUnavailable on an I/O error, TierFull when the tier or
        its write budget refuses, PageCorrupt when a page was damaged in the landing tier
        (it is quarantined and nothing of the batch is indexed)."""
        with self.lock:
            items = []
            for key in keys:
                arena = None if self.residence.has(key, 1) else self.landing.part_of(key)
                found = arena.find(key) if arena is not None else None
                if arena is not None and found is not None:
                    items.append((found[1], arena.view(found[0], found[1].payload_bytes)))
        try:
            why: list[str] = []
            held = self.write_down(1, items, wait=True, why=why) if items else 0
        except OSError as exc:
            raise TierUnavailable(
                f"durable write failed on the {self._target(1).name} tier ({exc.strerror or exc}); the pages are stored in RAM only"
            ) from exc
        if held < len(items) and why:
            raise LimitExceeded(f"durable write refused: {why[0]}; the pages are stored in RAM only")
        if held < len(items):
            raise TierFull(f"durable write refused: the {self._target(1).name} write budget (--ssd-dwpd) or the tier is "
                           "exhausted; the pages are stored in RAM only")

    def write_down(self, tier: int, items: list[tuple[PageHeader, memoryview]], wait: bool = False,
                   why: list[str] | None = None) -> int:
        """Writes landing pages (pinned by the caller, views of their slots) durably to
        ``tier`` and publishes them; returns how many of them ``tier`` holds now.

        Slots and budget are taken under the lock, pages written, verified, synced and
        indexed outside it. A page damaged in the landing tier is quarantined and nothing
        of the batch is indexed (PageCorrupt); an I/O error or a full index stores nothing
        (OSError, MetadataFull). ``wait``: a page another caller is writing to ``tier`` is
        waited for instead of skipped (a durable commit needs it there when it returns). A page
        its namespace's ssd share refuses is not written (the reason goes to ``why``). A page whose
        older copy there is being deleted (removed, invalidated) is written only once that delete
        is done (``wait``; else skipped): the delete would take the new copy; one whose delete
        waits for the page's last unpin is replaced (the delete is called off).
        """
        target = self._target(tier)
        placed: list[tuple[int, PageHeader, memoryview]] = []
        refused: set[bytes] = set()  # namespaces whose share refused a page of this batch
        with self.lock:
            waited = time.monotonic() + DOOMED_WAIT_S
            while wait and any((h.key, tier) in self._writing or self._deleting(h.key, tier) for h, _ in items):
                if any(self._deleting(h.key, tier) for h, _ in items) and time.monotonic() > waited:
                    break  # a delete that does not end (a failing device): those pages are skipped below
                self._settle_owed()
                self._written.wait(0.05)
            try:
                for header, payload in items:
                    if self.residence.has(header.key, tier) or (header.key, tier) in self._writing:
                        continue
                    if self._deleting(header.key, tier):  # the delete of its older copy would take this one
                        if why is not None:
                            why.append(f"an older copy of page {header.key.hex()} is being removed from the "
                                       f"{target.name} tier; retry")
                        continue
                    self.residence.revive(header.key, tier)  # a doomed older copy, if any: this one replaces it
                    if header.namespace_id in refused or not self._share_room(tier, header, [] if why is None else why):
                        refused.add(header.namespace_id)
                        continue  # its share is spent: its pages stay in RAM only, other namespaces' go on
                    if not target.charge(header.payload_bytes):
                        break  # over the endurance budget: the rest stays in RAM only
                    slot = self._reserve_lower(tier, header.payload_bytes)
                    if slot is None:
                        break
                    placed.append((slot, header, payload))
                    self._writing.add((header.key, tier))
                    self._placing(tier, header)
            except BaseException:
                self._unplace(target, tier, placed)
                raise
        try:
            behind = is_behind()
            verifier = self._behind_verifier if behind else self._verifier  # in the caller's class
            check = verifier.submit(_damages, [(header, payload) for _, header, payload in placed])
            for piece in write_pieces(placed, behind):
                target.write(piece)
            for (_, header, _), reason in zip(placed, check.result()):
                if reason is not None:
                    self.quarantine_landing(header, reason)
                    raise PageCorrupt(reason)
            target.commit([(slot, header) for slot, header, _ in placed], [self.residence.landing_orders.parent(h.key) for _, h, _ in placed])
        except BaseException as exc:  # whatever failed (a corrupt page, an I/O error, a bug below): nothing stays reserved
            with self.lock:
                self._unplace(target, tier, placed)
            if isinstance(exc, (OSError, MetadataFull)):
                self._io_failed(target.name, exc)
            raise
        self.metrics.ssd_errors_recent.set(0)
        with self.lock:
            self._publish(tier, [header for _, header, _ in placed])
            return sum(self.residence.has(header.key, tier) for header, _ in items)

    def _deleting(self, key: bytes, tier: int) -> bool:
        """Lock held: an older copy of ``key`` in ``tier`` is doomed and its delete owed or under
        way (the key pinned for it); a doomed copy waiting for a reader's unpin is not."""
        return self.residence.doomed(key, tier) and self.leases.moving(key)

    def _unplace(self, target: AdmittedTier, tier: int, placed: list[tuple[int, PageHeader, memoryview]]) -> None:
        for slot, header, _ in placed:
            target.unreserve(slot)
            self._writing.discard((header.key, tier))
            if self.shares is not None:
                self.shares.placed(header.key)
        self._written.notify_all()

    def _placing(self, tier: int, header: PageHeader) -> None:
        """Lock held: a page is placed in ``tier``; its namespace's share counts it (and its write)."""
        if self.shares is not None and tier == 1:
            self.shares.placing(header.key, header.namespace_id, self._target(tier).write_cost(header.payload_bytes),
                                header.payload_bytes)

    def _publish(self, tier: int, headers: list[PageHeader]) -> None:
        """Lock held: publishes written copies, except of pages removed meanwhile (their new
        copy is deleted once unpinned)."""
        target = self._target(tier)
        by_ns: dict[tuple[bytes, int], list[tuple[bytes, str, str, int]]] = {}
        for header in headers:
            self._writing.discard((header.key, tier))
            self.residence.revive(header.key, tier)
            by_ns.setdefault((header.namespace_id, header.generation), []).append(
                (header.key, self.node, target.name, header.payload_bytes))
        if headers:
            self.metrics.bytes_in.labels(target.name).inc(sum(header.payload_bytes for header in headers))
        for (namespace_id, generation), records in by_ns.items():
            listed = self.directory.publish_listed(namespace_id, records, generation)
            for key, _, _, _ in records:
                if key not in listed:
                    self.residence.drop(key, tier)
                if self.shares is not None:
                    self.shares.placed(key)  # counted by the directory now (or removed meanwhile)
        self._written.notify_all()

    def _io_failed(self, name: str, exc: Exception) -> None:
        self.metrics.ssd_errors.inc()
        if isinstance(exc, OSError):
            self.metrics.ssd_errors_recent.set(1)
        now = time.monotonic()
        if now - self._last_error_log > 10:  # one line per 10 s, not one per page
            self._last_error_log = now
            logger.error("%s tier: write failed (%s); serving from RAM, nothing stored is lost", name, exc)

    def quarantine_landing(self, header: PageHeader, reason: str, slot: int | None = None) -> None:
        """Drops a landing page that failed a check (lock not held). With ``slot``: only if
        the page is still kept there (it may have been stored again elsewhere meanwhile)."""
        with self.lock:
            arena = self.landing.part_of(header.key)
            if arena is None or slot is not None and arena.find(header.key) != (slot, header):
                return  # gone, or stored again meanwhile (maybe in the same slot): not the copy that failed
            self.residence.quarantine_held(header.key, LANDING, reason)  # its slot waits for its readers
            self.metrics.quarantined.labels(self.landing.name).inc()
            self.directory.remove(header.key, self.node, self.landing.name)
        self.unchecked.damaged(header)

    # -- reading up (lock not held) ------------------------------------------------------

    def read_up(self, items: list[tuple[int, bytes, int]]) -> ReadResult:
        """Reads pages (source tier, key, reserved landing slot), pinned by the caller, into
        their landing slots, headers checked, payloads not (their reader checks them). Stops
        at the first page that fails; a tier that
        fails as a whole (OSError) ends the prefix there, which proves nothing about bytes."""
        done = 0
        while done < len(items):
            tier, key = items[done][:2]
            source = self.residence.tiers[tier].part_of(key)  # of a lower tier, or of one above the landing tier
            if source is None:
                return ReadResult(done)  # gone meanwhile: a miss
            end = next((i for i in range(done, len(items))
                        if items[i][0] != tier or self.residence.tiers[tier].part_of(items[i][1]) is not source), len(items))
            run = items[done:end]
            views = [(key, self.landing.at(slot).view(slot, self.landing.at(slot).slot_bytes(slot))) for _, key, slot in run]
            try:
                result = source.read_into(views, verify=False)  # its reader checks the bytes (DESIGN §4)
            except OSError as exc:
                logger.error("%s tier: read failed: %s", source.name, exc)
                return ReadResult(done)
            done += result.num_read
            if result.num_read < len(run):
                return ReadResult(done, result.reason)
        return ReadResult(done)
