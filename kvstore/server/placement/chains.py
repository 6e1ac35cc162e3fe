"""Which page comes before which in its prefix, for the pages a tier holds.

A page is of use only while every page before it in its prefix is there (lookups are prefix
lookups), so an eviction order must give up the tail of a chain before its head. The
writer tells the tier each page's predecessor (commit order within a request, and the key
before its first page); this keeps those links for resident pages only: a page leaves
when it is removed, so memory is bounded by what the tier holds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Iterator
from typing import NamedTuple


def walks_from(key: bytes, pinned: Container[bytes]) -> bool:
    """Whether a victim search walks ``key``'s chain: it is not pinned, or pinned only as being
    moved down (walked through, never named: the pages after a round's orphan go first)."""
    return key not in pinned or key in getattr(pinned, "moving", ())


class PrefixLinks:
    """Predecessor links between resident pages. Not thread-safe (owner's lock)."""

    def __init__(self) -> None:
        self.parent: dict[bytes, bytes] = {}  # resident key -> the key before it
        # key (resident or not) -> the resident key after it, or a set when several are (rare:
        # prefixes are chains; one key, not a set, per page keeps an SSD tier's links small)
        self.children: dict[bytes, bytes | set[bytes]] = {}

    def link(self, key: bytes, parent: bytes) -> None:
        """``parent`` comes right before ``key``; a second link replaces the first. A link that
        would close a cycle (``key`` comes before ``parent`` already: links are the writers' word,
        and prefixes, which hash their predecessors, never loop) is not made: ``key`` heads a
        chain. Walks then have one end whichever page of a chain they start at."""
        if parent == key:
            return
        self.unlink(key)
        if key in self.children and self._comes_before(key, parent):
            return
        self.parent[key] = parent
        after = self.children.get(parent)
        if after is None:
            self.children[parent] = key
        elif isinstance(after, set):
            after.add(key)
        elif after != key:
            self.children[parent] = {after, key}

    def _comes_before(self, key: bytes, page: bytes) -> bool:
        """Whether ``key`` is ``page`` or before it in its chain (O(its depth); asked only of a
        page that has pages after it: one linked again, a page stored again)."""
        for _ in range(len(self.parent) + 1):
            if page == key:
                return True
            up = self.parent.get(page)
            if up is None:
                return False
            page = up
        return True  # a cycle already (not made here): not linked into it either

    def unlink(self, key: bytes) -> list[bytes]:
        """``key`` left the tier: forgets its own link. Returns the resident pages right
        after it (of no use now); their links stay, so they are adopted if it comes back."""
        parent = self.parent.pop(key, None)
        if parent is not None:
            after = self.children[parent]
            if not isinstance(after, set):
                del self.children[parent]
            else:
                after.discard(key)
                if len(after) == 1:
                    self.children[parent] = next(iter(after))
        return list(self.after(key))

    def after(self, key: bytes) -> Collection[bytes]:
        after = self.children.get(key)
        return () if after is None else after if isinstance(after, set) else (after,)

    def deepest(self, key: bytes, evictable: Callable[[bytes], bool], pinned: Container[bytes],
                 blocked: set[bytes], spent: set[bytes] | None = None, walked: list[bytes] | None = None) -> bytes | None:
        """The last page of ``key``'s chain (following links to ``evictable`` pages) that is not
        being moved down, or None when that page is pinned: a pinned page keeps the pages before
        it (without them it is of no use once read), not those after it, which go first as any
        chain's tail does (and as ``TailFirst``'s shortcuts give them up). A page being moved
        down is walked through, never named (it leaves on its own, or stays when its write
        fails): what a put committed after it is still the chain's tail, and goes before the
        pages ahead of it (DESIGN §6); so at a branch the walk follows a page not being moved,
        else one that leads to such a page (``onward``). The pages seen on the way to a pinned
        page join ``blocked``, those of a walk that met only pages being moved ``spent`` (one
        victim search walks each chain once). A cycle a writer made up (links are the writers'
        word) ends the walk at its first page seen twice: a walk costs its chain's length, and
        the pages being moved after it, never the tier's size. ``walked`` (when given) gets the
        pages of a walk down a chain without a branch or a cycle: the walks ``TailFirst`` may
        remember (its shortcuts; its kept chains, of those whose last page is not being moved),
        since at a branch the walk's choice may change with no link changing."""
        moving: Container[bytes] = getattr(pinned, "moving", ())
        spent = set() if spent is None else spent
        seen: dict[bytes, None] = {}  # in walk order
        last: bytes | None = None  # the deepest page seen that is not being moved down
        linear = True  # no branch, no cycle
        step: bytes | None = key
        while step is not None and step not in blocked and step not in spent:
            linear = linear and step not in seen
            key, after = step, self.after(step) if step not in seen else ()
            if len(after) == 1:  # a chain, mostly: no branch to choose
                step = next(iter(after))
                step = step if evictable(step) else None
            else:
                linear = linear and len(after) == 0
                step = self.onward(after, evictable, moving, spent)
            seen[key] = None
            if key not in moving:
                last = key
        if walked is not None and linear and step is None:
            walked.extend(seen)
        if step is not None and step in blocked:
            blocked.update(seen)  # a pinned page further on keeps these
            return None
        if last is None:
            spent.update(seen)  # every page walked is being moved down: the pages before them may go
            return None
        if last not in pinned:
            return last
        blocked.update(seen)
        return None

    def onward(self, after: Collection[bytes], evictable: Callable[[bytes], bool], moving: Container[bytes],
               spent: set[bytes]) -> bytes | None:
        """The page a walk follows of those ``after`` a page: one not being moved down, else one
        that leads to such a page through pages being moved (a branch of those alone leads nowhere)."""
        held = [k for k in after if evictable(k)]
        live = next((k for k in held if k not in moving), None)
        if live is not None or len(held) < 2:
            return live if live is not None else next(iter(held), None)
        return next((k for k in held if not self.all_moving(k, evictable, moving, spent)), held[0])

    def all_moving(self, key: bytes, evictable: Callable[[bytes], bool], moving: Container[bytes],
                   spent: set[bytes]) -> bool:
        """Whether ``key`` and every page after it reached through pages being moved are being
        moved down; then they join ``spent`` (each visited once a search)."""
        seen, stack = {key}, [key]
        while stack:
            page = stack.pop()
            if page in spent:
                continue
            if page not in moving:
                return False
            for k in self.after(page):
                if k not in seen and evictable(k):
                    seen.add(k)
                    stack.append(k)
        spent.update(seen)
        return True


class _Picked(NamedTuple):
    """The last victim a search named, for ``TailFirst``'s shortcuts."""

    candidate: bytes  # the LRU page whose chain it ended
    victim: bytes
    moves_ended: int | None  # the pins' ``moves_ended`` then (None: not known)
    linear: bool  # the way from candidate to victim had no branch: only then is a shortcut the walk's answer


class TailFirst:
    """A least-recently-used order (its owner's) given up tail first: the victim is the
    deepest page of the least recently used page's chain, so the head of a prefix goes
    last. For a tier whose pages are written or read head first (the SSD tier: durable
    puts, write-downs, read-ups), where plain LRU would take the head first. The page
    before the last victim is remembered, so a chain is given up in O(1) a page. A chain
    whose last page is kept (an open allocation leans on it, a caller pinned it) is
    remembered too, each of its pages with that end (``_kept``): while the end stays kept
    and the links stay, a search passes its pages in O(1) each rather than walking the
    chain again from each one. Not thread-safe (owner's lock)."""

    def __init__(self) -> None:
        self.links = PrefixLinks()
        self._picked: _Picked | None = None
        self._next: tuple[bytes, bytes] | None = None    # (that candidate, the page before the victim, evicted)
        self._kept: dict[bytes, bytes] = {}              # page -> the kept last page of its chain (linear)
        self._kept_pages: dict[bytes, set[bytes]] = {}   # that last page -> the pages remembered with it

    def link(self, key: bytes, parent: bytes) -> None:
        """``parent`` comes right before ``key`` (PrefixLinks.link). A page linked again, or a
        second page after one, may change a chain the shortcuts remember: they are dropped; a
        round's (``_picked``) at any link, since a page linked after one it named (being moved,
        so walked through) is that chain's new tail. A kept chain through either page is
        forgotten (its end moved on, or it branches now)."""
        if key in self.links.parent or self.links.after(parent):
            self.forget()
        self._picked = None
        self._unkeep(key)
        self._unkeep(parent)
        self.links.link(key, parent)

    def _unkeep(self, key: bytes | None) -> None:
        """Forgets the kept chain ``key`` is a page of (its last page maps to itself)."""
        if key is not None:
            for page in self._kept_pages.pop(self._kept.get(key, key), ()):
                self._kept.pop(page, None)

    def removed(self, key: bytes, evicted: bool = False) -> list[bytes]:
        """``key`` left the tier (``evicted``: as the victim named last, maybe). Returns the
        resident pages right after it (PrefixLinks.unlink); the shortcuts as ``changed`` says."""
        before = self.links.parent.get(key)
        self._unkeep(key)
        picked = self._picked
        if evicted and before is not None and picked is not None and picked.victim == key != picked.candidate and picked.linear:
            self._next = (picked.candidate, before)  # where the next search down that chain ends: not walked again
        else:
            self.changed(key)
        return self.links.unlink(key)

    def changed(self, key: bytes, followed: bool = False) -> None:
        """``key`` left, or stopped or started (``followed``) being a page the walk follows (its
        owner's ``held``: a page hinted, say). A page with pages after it, or a candidate the
        shortcuts remember, may change the chain they remember: they are dropped, the next
        search walks. A chain's last page changes no walk but one that ends there, which the
        shortcuts' own checks catch (the pages of a demotion batch leave so, tail first), save
        one followed again after a round's victim and the pages being moved after it (the
        round's shortcut is dropped). A remembered end itself leaving is forgotten: stored
        again elsewhere, it would pass those checks as the end of a chain it is no longer in."""
        if self.links.after(key) or key in (self._picked or ())[:1] or key in (self._next or ())[:1]:  # a candidate
            self.forget()
        self._unkeep(key)
        self._unkeep(self.links.parent.get(key))  # a page followed again after a kept chain's end
        if followed:
            self._picked = None
        if self._next is not None and self._next[1] == key:
            self._next = None
        if self._picked is not None and self._picked.victim == key:
            self._picked = None

    def forget(self) -> None:
        """Drops the shortcuts: the next search walks its chain."""
        self._picked = self._next = None

    def ends(self, order: Iterable[bytes], held: Callable[[bytes], bool], pinned: Container[bytes]) -> Iterator[tuple[int, bytes]]:
        """The order as a sort key (DESIGN §6): (position in ``order``, the last page of its chain)
        for each page of ``order`` whose chain may go now; a page's priority is the first
        position that names it, and ``victim`` names a page of the least. O(pages x depth):
        the definition that ``victim``'s O(1)-a-page search is held to (tests), not a path."""
        for position, key in enumerate(order):
            if walks_from(key, pinned) and (last := self.links.deepest(key, held, pinned, set())) is not None:
                yield position, last

    def victim(self, order: Iterable[bytes], held: Callable[[bytes], bool], pinned: Container[bytes]) -> bytes | None:
        """The page to go: ``order`` lists the held pages least recently used first."""
        blocked: set[bytes] = set()  # chains a pinned page keeps
        spent: set[bytes] = set()  # pages with only pages being moved after them
        moving: Container[bytes] = getattr(pinned, "moving", ())
        kept, still = self._kept, {}  # a remembered kept end -> whether it keeps its chain now
        for key in order:
            if (end := kept.get(key)) is not None:
                if (keeps := still.get(end)) is None:
                    keeps = still[end] = end in pinned and end not in moving
                if keeps:
                    continue
            if walks_from(key, pinned) and (found := self._deepest(key, held, pinned, blocked, spent))[0] is not None:
                self._picked = _Picked(key, found[0], getattr(pinned, "moves_ended", None), found[1])
                return found[0]
        return None

    def _deepest(self, key: bytes, held: Callable[[bytes], bool], pinned: Container[bytes], blocked: set[bytes],
                 spent: set[bytes]) -> tuple[bytes | None, bool]:
        """The page to go in ``key``'s chain, and whether the way to it had no branch; the one
        before the last victim of the same chain when that is now its end (a chain is given
        up in O(1) a page, not O(depth)), when the way to that victim had no branch: the last
        victim evicted, or being moved down (a demotion batch picks its pages before any of
        them leaves) while no move has ended since it was named: every page the walk went
        through after it is still being moved, none followed again (a round's write that
        failed leaves its pages in place, the chain's tail again)."""
        if self._next is not None and self._next[0] == key:
            end = self._next[1]
            if end not in pinned and held(end) and not any(map(held, self.links.after(end))):
                return end, True
        if (end := self._round_end(key, held, pinned, spent)) is not None:
            return end, True
        walked: list[bytes] = []
        last = self.links.deepest(key, held, pinned, blocked, spent, walked)
        if walked and last is None and walked[-1] not in getattr(pinned, "moving", ()):
            # blocked at its own last page: remembered until that page or a link changes
            self._kept_pages.setdefault(walked[-1], set()).update(walked)
            self._kept.update(dict.fromkeys(walked, walked[-1]))
        return last, bool(walked)

    def _round_end(self, key: bytes, held: Callable[[bytes], bool], pinned: Container[bytes], spent: set[bytes]) -> bytes | None:
        """The page before the last victim of ``key``'s chain while that victim is being moved
        down by a round that named it (no move ended since) and it is that chain's end now:
        every other page after it is being moved too, as is all that follows them."""
        picked, moving = self._picked, getattr(pinned, "moving", ())
        if (picked is None or picked.candidate != key or picked.victim == key or picked.victim not in moving
                or not picked.linear or picked.moves_ended is None or picked.moves_ended != getattr(pinned, "moves_ended", None)):
            return None
        end = self.links.parent.get(picked.victim)
        if end is None or end in pinned or not held(end):
            return None
        for k in self.links.after(end):
            if held(k) and (k not in moving or k != picked.victim and not self.links.all_moving(k, held, moving, spent)):
                return None
        return end
