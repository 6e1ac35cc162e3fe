"""One table between kvstore errors and gRPC status codes, used by servicers and client."""

from __future__ import annotations

import json
from typing import Any

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


ERROR_METADATA_KEY = "kvstore-error"  # trailing metadata: the exact error class (and its fields: error_label)


def error_label(exc: errors.KVStoreError) -> str:
    """What the server sends beside the status: the class's name, and for a class whose figures
    are fields (QuotaExceeded), those fields as JSON after a space (ASCII, one line: it travels
    as gRPC metadata and as the call socket's error line)."""
    fields = getattr(exc, "fields", None)
    return type(exc).__name__ if fields is None else f"{type(exc).__name__} {json.dumps(fields(), sort_keys=True)}"


def error_class(label: str) -> str:
    """The class name of an ``error_label``."""
    return label.partition(" ")[0]


MAX_LABEL_CHARS = 1024  # an error_label's fields: a QuotaExceeded's are ~150 characters


def _fields(text: str, kinds: dict[str, type]) -> dict[str, Any] | None:
    """A label's fields when they are exactly the class's (``kinds``: name -> type), each of its type.
    Anything else (too long, too deep, other names or types: a buggy or hostile server) is None."""
    if len(text) > MAX_LABEL_CHARS:
        return None
    try:
        fields = json.loads(text)
    except (ValueError, RecursionError):
        return None
    ok = isinstance(fields, dict) and fields.keys() == kinds.keys() and all(type(v) is kinds[k] for k, v in fields.items())
    return fields if ok else None


def named_error(name: str, message: str) -> errors.KVStoreError | None:
    """The exception an ``error_label`` names (its class, built from its fields where it has them;
    a class that cannot be built so, its nearest base that can); None for a name that is no error class."""
    label, _, rest = name.partition(" ")
    named = getattr(errors, label, None) if label else None
    if not (isinstance(named, type) and issubclass(named, errors.KVStoreError)):
        return None
    for cls in named.__mro__:  # a class that carries more than its fields (HostQuotaFull): its nearest base
        if issubclass(cls, errors.KVStoreError):
            kinds = cls.__dict__.get("FIELDS")  # the class's own: a subclass adds what its base cannot build
            fields = _fields(rest, kinds) if rest and kinds else None
            try:
                return cls(**fields) if fields is not None else cls(message)
            except TypeError:
                continue
    return None


def error_for(code: grpc.StatusCode, message: str, name: str | None = None) -> errors.KVStoreError:
    """The client-side exception for a status the server sent (``name``: the ``error_label``
    the server sent, when it did), else the first class of the status's row."""
    named = named_error(name, message) if name else None
    if named is not None:
        return named
    for cls, known in ERROR_CODES:
        if known == code:
            return cls(message)
    return errors.KVStoreError(f"{code.name}: {message}")
