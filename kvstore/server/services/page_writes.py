"""WritePages (DESIGN §4, §8): a stream's pages allocated and committed a group at a time.

More: kvstore/server/services/README.md (### page_writes.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvstore import validate
from kvstore._proto import data_pb2
from kvstore.errors import InvalidRequest, KVStoreError, LeaseExpired, StreamCut
from kvstore.page_wire.grpc_chunks import MAX_ANNOUNCED_KEYS, BufferSink, ChunkedPage, WireChunk
from kvstore.security.identity import Identity
from kvstore.server.placement import Placement
from kvstore.server.tenancy.gate import Gate

logger = logging.getLogger(__name__)

GROUP_PAGES = 32  # pages one allocation and commit take at most
GROUP_BYTES = 64 << 20  # and bytes: a page is findable at most this far behind the stream


@dataclass
class _Group:
    """One allocation of a stream: ``keys`` as ``Placement.allocate`` answered (a prefix of those
    asked), ``written`` per key (False: stored already, its bytes only checked), the pages verified so
    far (``checksums``, in order), and ``meta``, its first chunk, which the other pages must match."""

    allocation_id: bytes
    keys: list[bytes]
    written: list[bool]
    meta: data_pb2.PageChunk
    claimed: bool
    renewed_s: float
    checksums: list[int] = field(default_factory=list)
    num_written: int = 0  # of the verified pages, those written into a slot (they become host bytes at commit)

    def continued_by(self, meta: data_pb2.PageChunk) -> bool:
        """Whether the page starting with ``meta`` is this group's next, in the same destination."""
        i, first = len(self.checksums), self.meta
        return (i < len(self.keys) and self.keys[i] == meta.key and meta.namespace_id == first.namespace_id
                and meta.page_bytes == first.page_bytes and meta.durable == first.durable and meta.flags == first.flags
                and meta.session_id == first.session_id and meta.layout == first.layout
                and meta.HasField("generation") == first.HasField("generation") and meta.generation == first.generation)


class PageWrites:
    """The WritePages handler's work, one ``_Stream`` per call."""

    def __init__(self, core: Placement, gate: Gate) -> None:
        self.core = core
        self.gate = gate  # room, claim, allocation and commit of each group for its tenant (tenancy/gate.py)

    def write(self, chunks: Iterable[WireChunk], who: Identity) -> int:
        """Stores the stream's pages; returns how many leading ones are stored (durable: on ssd)."""
        stream = _Stream(self, who)
        try:
            for chunk in chunks:
                if not stream.take(chunk):
                    return stream.stored
            stream.end()
        except BaseException:
            stream.cut()
            raise
        return stream.stored


class _Stream:
    def __init__(self, writes: PageWrites, who: Identity) -> None:
        self.w = writes
        self.who = who
        self.stored = 0
        self.parent: bytes | None = None  # the page before the next one: each follows the one before it in the stream
        self.ahead: list[bytes] = []  # the keys announced after the last page started
        self.group: _Group | None = None
        self.page: ChunkedPage | None = None

    def take(self, chunk: WireChunk) -> bool:
        """Takes the next chunk; False when a commit came back short (the stream ends there)."""
        if chunk.error:
            raise InvalidRequest(f"WritePages: {chunk.error}")
        if self.page is None or chunk.offset == 0:
            if self.page is not None:
                raise self.page.truncated()
            if not self._start(chunk):
                return False
        assert self.page is not None and self.group is not None
        if not self.page.add(chunk):
            return True
        done, self.page, group = self.page, None, self.group
        group.num_written += done.sink is not None
        group.checksums.append(done.expected)
        self.parent = done.key
        return len(group.checksums) < len(group.keys) or self._commit()

    def end(self) -> None:
        if self.page is not None:
            raise StreamCut(str(self.page.truncated()))
        self._commit()

    def cut(self) -> None:
        """The stream failed: the verified pages of the open group are committed, the rest given back."""
        if self.page is not None:
            self.page.abandon()
            self.page = None
        group = self.group
        if group is None:
            return
        try:
            self._commit()
        except KVStoreError as exc:  # the call's own error is the one it answers
            logger.info("WritePages cut: the %d verified pages of its last group were not stored: %s", len(group.checksums), exc)
        finally:
            self.w.core.abort(group.allocation_id)  # a no-op once committed or given back

    def _start(self, chunk: WireChunk) -> bool:
        """A page's first chunk: in its group, or after committing that one, in a new one."""
        meta = chunk.meta
        key = validate.keys([meta.key], 1)[0]
        if meta.next_keys:
            if len(meta.next_keys) > MAX_ANNOUNCED_KEYS:
                raise InvalidRequest(f"next_keys holds {len(meta.next_keys)} keys, at most {MAX_ANNOUNCED_KEYS}")
            self.ahead = validate.keys(list(meta.next_keys), MAX_ANNOUNCED_KEYS)
        elif self.ahead and self.ahead[0] == key:
            del self.ahead[0]
        else:
            self.ahead = []  # the stream left what it announced
        group = self.group
        if group is None or not group.continued_by(meta):
            if group is not None and not self._commit():
                return False
            if self.parent is None and self.stored == 0 and meta.parent:
                self.parent = validate.keys([meta.parent], 1)[0]
            group = self.group = self._allocate(chunk, key)
        i = len(group.checksums)
        now = time.monotonic()
        if now - group.renewed_s > self.w.core.config.allocation_ttl_ms / 2000:  # a slow stream keeps its group
            try:
                self.w.gate.renew(self.who, group.allocation_id, 0)
            except LeaseExpired:
                raise self._stalled(group) from None
            group.renewed_s = now
        sink = BufferSink(self.w.core.slot_view(group.allocation_id, key), clear_on_failure=False) if group.written[i] else None
        self.page = ChunkedPage(key, chunk.page_bytes, chunk.checksum, sink, f"page {key.hex()}", InvalidRequest)
        return True

    def _allocate(self, chunk: WireChunk, key: bytes) -> _Group:
        """Checks a page's first chunk and allocates the slots of its group (none for pages stored
        already: their bytes are only checked)."""
        ns = validate.namespace_id(chunk.namespace_id)
        layout = validate.layout(chunk.layout)
        if chunk.page_bytes != layout.page_bytes:
            raise InvalidRequest(f"page_bytes {chunk.page_bytes} does not match the layout ({layout.page_bytes})")
        if chunk.offset != 0:
            raise InvalidRequest("the first chunk of a page must have offset 0")
        meta, who, w = chunk.meta, self.who, self.w
        generation = validate.generation(meta.generation) if meta.HasField("generation") else None
        cap = max(1, min(GROUP_PAGES, GROUP_BYTES // layout.page_bytes))
        keys = [key, *self.ahead[: cap - 1]]
        allocation_id, slots, claimed = w.gate.open_group(who, ns, layout, keys, self.parent, generation, meta.session_id)
        return _Group(allocation_id, [k for k, _ in slots], [s is not None for _, s in slots], meta, claimed, time.monotonic())

    def _stalled(self, group: _Group) -> LeaseExpired:
        """A stream that paused past the allocation ttl inside a group: its slots are gone (a WritePages
        client never allocated, so "allocate again" would mislead it)."""
        return LeaseExpired(f"the stream paused more than the allocation ttl ({self.w.core.config.allocation_ttl_ms} ms) "
                            f"between pages of one group: of its {len(group.keys)} pages from {group.keys[0].hex()} on, those not "
                            f"held already are not stored ({self.stored} pages before them are); send them again")

    def _commit(self) -> bool:
        """Commits the open group's verified pages (frees its other slots); False when fewer of them are stored."""
        group, self.group = self.group, None
        if group is None:
            return True
        meta = group.meta
        verified = group.keys[: len(group.checksums)]
        try:
            n = self.w.gate.commit_group(self.who, group.allocation_id, meta.namespace_id, meta.session_id, verified, group.checksums,
                                         meta.durable, meta.flags, group.num_written * meta.page_bytes, group.claimed)
        except LeaseExpired:  # the allocation aborted
            raise self._stalled(group) from None
        self.stored += n
        return n == len(verified)
