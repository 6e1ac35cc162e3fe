"""What a finished vLLM request saves again (resave.py): nothing of a request a save of which a
session fence refused, also when a save of it planned before the refusal was reported ends short
afterwards (the fence refuses that one too); as for a request refused as stale
(test_vllm_stale_review.py drives that case through the connector's parts). Once the request is
reported finished its refusal is forgotten."""

from __future__ import annotations

from kvstore.client.adapters.vllm.metadata import SaveSpec
from kvstore.client.adapters.vllm.resave import Unsaveds


def _spec(req_id: str, first_page: int, pages: int) -> SaveSpec:
    return SaveSpec(req_id, list(range(pages * 16)), list(range(pages)), first_page, "session", 0)


def test_a_fenced_request_saves_nothing_again_after_a_later_short_save() -> None:
    unsaved = Unsaveds(wait_s=1.0)
    assert unsaved.fenced("r")
    unsaved.ended_short(_spec("r", 2, 4), 2)  # the next chunk's save, planned before the fence was reported
    assert unsaved.to_save("r", True) is None and not unsaved.waiting("r")
    assert unsaved.take_fenced() == {"r"}


def test_a_refusal_is_forgotten_once_the_request_is_reported_finished() -> None:
    unsaved = Unsaveds(wait_s=1.0)
    unsaved.stale("r")
    unsaved.finished({"r"})
    unsaved.ended_short(_spec("r", 0, 2), 1)  # the id of a new request (vLLM's are unique; this checks the set empties)
    assert unsaved.to_save("r", True) is not None
