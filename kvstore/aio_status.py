"""The status a server sent on a grpc.aio call, kept where grpc.aio overwrites it.

When a server ends a client-streaming call (WritePages refused at a chunk) while the client's
next write is in flight, grpc.aio's failed write replaces the status the server sent with
``INTERNAL: Internal error from Core`` (grpc/grpc#36066; fix proposed in #43486): a fenced
save, a quota refusal or a corrupt chunk would reach the caller as an internal error. The core
call object receives the server's status first; a done callback on it keeps that status, and
``instead_of`` answers with it. Private attributes of grpc.aio are read with ``getattr``: where
a grpc release lacks them nothing is kept and the error is what grpc.aio reports."""

from __future__ import annotations

from typing import Any

import grpc
from grpc import _common

OVERWRITTEN = "Internal error from Core"  # grpc.aio's details when a failed write set the status


def _overwritten(code: Any, details: str | None) -> bool:
    return details == OVERWRITTEN and code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INTERNAL.value[0])


class KeptStatus:
    """Watches one call (plain or intercepted) for the first status that is not grpc.aio's own."""

    def __init__(self, call: Any) -> None:
        self.status: Any = None  # the core's AioRpcStatus, once the call ended with one
        self._watch(call)

    def _watch(self, call: Any) -> None:
        core = getattr(call, "_cython_call", None)
        if core is not None:
            core.add_done_callback(lambda: self._keep(core))
            return
        task = getattr(call, "_interceptors_task", None)  # an intercepted call: the call its interceptors made
        if task is not None:
            task.add_done_callback(lambda t: None if t.cancelled() or t.exception() is not None else self._watch(t.result()))

    def _keep(self, core: Any) -> None:
        status = getattr(core, "_status", None)
        if self.status is None and status is not None and not _overwritten(status.code(), status.details()):
            self.status = status

    def instead_of(self, exc: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
        """``exc``, or the server's own status where grpc.aio overwrote it."""
        status = self.status
        if status is None or not _overwritten(exc.code(), exc.details()):
            return exc
        code = _common.CYGRPC_STATUS_CODE_TO_STATUS_CODE.get(status.code())
        if code is None or code == grpc.StatusCode.OK:
            return exc  # the server answered; only the response was lost: the failure stands
        return grpc.aio.AioRpcError(code, exc.initial_metadata(), grpc.aio.Metadata.from_tuple(status.trailing_metadata()),
                                    status.details(), status.debug_error_string())
