"""One table between kvstore errors and gRPC status codes, used by servicers and client."""

from __future__ import annotations

import grpc

from kvstore import errors

# Most specific first: the first matching class wins.
ERROR_CODES: list[tuple[type[errors.KVStoreError], grpc.StatusCode]] = [
    (errors.NamespaceMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.StaleIncarnation, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.StaleGeneration, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.SessionFenced, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.CannotConverge, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.TierFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.LimitExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.PageMissing, grpc.StatusCode.NOT_FOUND),
    (errors.PageCorrupt, grpc.StatusCode.DATA_LOSS),
    (errors.LeaseExpired, grpc.StatusCode.ABORTED),
    (errors.TierUnavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
]


def code_for(exc: errors.KVStoreError) -> grpc.StatusCode:
    for cls, code in ERROR_CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


ERROR_METADATA_KEY = "kvstore-error"  # trailing metadata naming the exact error class


def error_for(code: grpc.StatusCode, message: str, name: str | None = None) -> errors.KVStoreError:
    """The client-side exception for a status the server sent (``name``: the class the
    server raised, from trailing metadata, when it says)."""
    named = getattr(errors, name, None) if name else None
    if isinstance(named, type) and issubclass(named, errors.KVStoreError):
        for cls in named.__mro__:  # a class that carries more than a message (HostQuotaFull): its nearest base
            if issubclass(cls, errors.KVStoreError):
                try:
                    return cls(message)
                except TypeError:
                    continue
    for cls, known in ERROR_CODES:
        if known == code:
            return cls(message)
    return errors.KVStoreError(f"{code.name}: {message}")
