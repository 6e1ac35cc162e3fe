"""What a lookup found, and how a transfer that ends early says what it delivered.

Every transport reports a short transfer the same way: PageMissing or PageCorrupt with
``num_tokens``, the leading tokens of the caller's tensor that are valid (whole pages).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import KVStoreError, PageMissing
from kvstore.types import Location, LocationRun


@dataclass(frozen=True)
class Hit:
    """The stored prefix of a token sequence: ``num_tokens`` leading tokens (whole pages)."""

    namespace_id: bytes
    num_tokens: int
    keys: list[bytes] = field(repr=False)
    runs: list[LocationRun] = field(repr=False)  # where the pages are, run-length encoded, in order
    # the namespace's generation the pages belong to: a writer that computes the rest from them names
    # it to ``put`` (generation=...), so that its write is refused once an invalidation raised it
    generation: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def locations(self) -> list[Location]:
        """One location per page (expanded from ``runs``)."""
        return [Location(r.node, r.tier, 0, r.size_bytes) for r in self.runs for _ in range(r.num_pages)]


def partial(cls: type[KVStoreError], message: str, num_tokens: int) -> KVStoreError:
    """``cls(message)`` carrying ``num_tokens``: the leading tokens that are in place."""
    exc = cls(message)
    exc.num_tokens = num_tokens  # type: ignore[attr-defined]
    return exc


def missing(num_pages: int, done: int, page_tokens: int) -> KVStoreError:
    """A get of ``num_pages`` promised pages that found page ``done`` gone."""
    return partial(
        PageMissing,
        f"lookup promised {num_pages} pages but page {done} is no longer stored; "
        f"{done * page_tokens} tokens are valid, recompute the rest",
        done * page_tokens,
    )


def published_prefix(asked: int, num_published: int, durable: bool, first_page: int, page_tokens: int) -> int:
    """The pages of a commit's ``asked`` that the server reports stored (a prefix). A
    durable write that comes back short raises: the pages after it are not on ssd."""
    n = min(asked, num_published)
    if durable and n < asked:
        done = (first_page + n) * page_tokens
        raise partial(PageMissing, f"durable write: page {first_page + n} was removed before its commit, so it is "
                      f"not on ssd; {done} leading tokens are durable", done)
    return n
