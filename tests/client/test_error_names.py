"""The client raises the class the server named (trailing metadata, or the call socket's
error answer), so that an engine catches the same class whichever side raised it."""

from __future__ import annotations

import grpc
import pytest

from kvstore import errors
from kvstore.status import ERROR_CODES, code_for, error_for


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
