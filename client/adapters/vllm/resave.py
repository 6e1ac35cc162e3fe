"""What a finished request still has to save: the pages its saves left unstored.

More: client/adapters/vllm/README.md (### resave.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvstore.client.adapters.vllm.metadata import SaveSpec


@dataclass
class Unsaved:
    spec: SaveSpec  # the longest save of the request that ended short (its tokens and blocks)
    stored: int  # leading pages that may be stored
    tried: bool = False  # saved again already (or given up on): never a second time
    wait_until: float | None = None  # finished with no store to reach: how long its blocks are held for one


class Unsaveds:
    """Per request, what its short saves left unsaved (see the module docstring)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s  # how long a finished request waits for a store to save again to
        self._by_req: dict[str, Unsaved] = {}
        self._fenced: set[str] = set()  # not reported yet
        # refused as stale or by a fence: nothing is saved again for them until they finish
        self._refused: set[str] = set()

    def fenced(self, req_id: str) -> bool:
        """A save of ``req_id`` was refused by its session's fence: forgotten, to be reported; a
        save of it that ends short later is not saved again either (the fence refuses it too).
        True: the save ended (worker.py's ``_ended``)."""
        self._by_req.pop(req_id, None)
        self._fenced.add(req_id)
        self._refused.add(req_id)
        return True

    def take_fenced(self) -> set[str]:
        fenced, self._fenced = self._fenced, set()
        return fenced

    def stale(self, req_id: str) -> None:
        """A save of ``req_id`` was refused as stale: a save of it that ends short later (planned
        before the refusal was reported) is not saved again either (it names the same generation)."""
        self._by_req.pop(req_id, None)
        self._refused.add(req_id)

    def finished(self, req_ids: set[str]) -> None:
        """Requests reported finished: forgotten, their refusals too."""
        self.forget(req_ids)
        self._refused -= req_ids

    def ended_short(self, spec: SaveSpec, stored_pages: int) -> None:
        if spec.req_id in self._refused:
            return
        known = self._by_req.get(spec.req_id)
        if known is None:
            self._by_req[spec.req_id] = Unsaved(spec, stored_pages)
            return
        known.stored = min(known.stored, stored_pages)
        if len(spec.tokens) > len(known.spec.tokens):
            known.spec = spec

    def ended_whole(self, spec: SaveSpec) -> None:
        """A save stored all its pages: what it covers is no longer unsaved."""
        known = self._by_req.get(spec.req_id)
        if known is not None and spec.first_page <= known.stored and len(spec.tokens) >= len(known.spec.tokens):
            del self._by_req[spec.req_id]

    def forget(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._by_req.pop(req_id, None)

    def to_save(self, req_id: str, store_reachable: bool) -> SaveSpec | None:
        """For a finished request, the save to make now (once), from the first page that
        may be unstored to the end of its longest save; None when there is none to make
        now (nothing unsaved, tried already, or no store to reach yet)."""
        known = self._by_req.get(req_id)
        if known is None or known.tried:
            return None
        if not store_reachable:
            now = time.monotonic()
            if known.wait_until is None:
                known.wait_until = now + self.wait_s
            known.tried = now >= known.wait_until  # given up on: the blocks go back to vLLM
            return None
        known.tried = True
        return SaveSpec(req_id, known.spec.tokens, known.spec.block_ids, known.stored, known.spec.session_id,
                        known.spec.generation)  # a fence refuses it too

    def waiting(self, req_id: str) -> bool:
        """True while a finished request still waits for its save again (its blocks stay held)."""
        known = self._by_req.get(req_id)
        return known is not None and not known.tried
