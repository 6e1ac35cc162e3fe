"""The client raises the class the server named (trailing metadata, or the call socket's
error answer), so that an engine catches the same class whichever side raised it."""

from __future__ import annotations

import grpc
import pytest

from kvstore import errors
from kvstore.status import ERROR_CODES, code_for, error_class, error_for, error_label


def test_a_named_class_that_needs_more_than_a_message_becomes_its_nearest_base() -> None:
    """HostQuotaFull (a LimitExceeded) carries keep_bytes, so the client cannot build it from
    a message. Bug: error_for then fell back to the first class of the status code's row,
    TierFull for RESOURCE_EXHAUSTED, which is no LimitExceeded: an engine catching
    LimitExceeded missed a quota refusal from a server that names HostQuotaFull (one before
    the servicer raised LimitExceeded itself, or any path that lets it through)."""
    exc = error_for(grpc.StatusCode.RESOURCE_EXHAUSTED, "tenant 'a' holds 10 host bytes", "HostQuotaFull")
    assert isinstance(exc, errors.LimitExceeded), type(exc).__name__
    assert str(exc) == "tenant 'a' holds 10 host bytes"


@pytest.mark.parametrize("cls", [cls for cls, _ in ERROR_CODES] + [errors.MetadataFull, errors.StreamCut])
def test_every_class_a_server_names_comes_back_as_itself(cls: type[errors.KVStoreError]) -> None:
    exc = error_for(code_for(cls("m")), "m", cls.__name__)
    assert type(exc) is cls and str(exc) == "m"


def test_a_quota_refusal_comes_back_with_its_figures() -> None:
    """The server sends a QuotaExceeded's fields with its class (status.error_label): the client
    builds the same refusal, figures and message alike, with nothing read from the text."""
    sent = errors.QuotaExceeded("a", "host_bytes", 4096, 1024, 4096, freed=2048)
    got = error_for(code_for(sent), str(sent), error_label(sent))
    assert isinstance(got, errors.QuotaExceeded) and got.fields() == sent.fields() and str(got) == str(sent)
    assert error_class(error_label(sent)) == "QuotaExceeded"


@pytest.mark.parametrize("fields", ['{"tenant": "a"}', "not json", '["a"]', '{"tenant": {"x": 1}}', '{"__class__": 1}'])
def test_a_quota_label_whose_fields_do_not_fit_comes_back_as_its_message(fields: str) -> None:
    """Fields that are not the class's (a malformed or hostile answer) never raise in the client: the
    refusal comes back as its nearest class that takes the message alone."""
    got = error_for(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused", f"QuotaExceeded {fields}")
    assert isinstance(got, errors.LimitExceeded) and str(got) == "refused"
