"""The client's one I/O runtime: a private event loop on a thread of its own, owning the
one ``grpc.aio`` channel to the server and (``local``) the call socket's channel for this loop.

More: client/README.md (### runtime.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc

from kvstore._proto import data_pb2_grpc, directory_pb2_grpc, handoff_pb2_grpc
from kvstore.aio_status import KeptStatus
from kvstore.callsocket.client_aio import AsyncCallChannel
from kvstore.client.forked import ProcessCheck
from kvstore.errors import KVStoreError
from kvstore.page_wire.grpc_chunks import CLIENT_OPTIONS, PageStubs
from kvstore.security.channel import ClientTLS, aio_channel
from kvstore.status import ERROR_METADATA_KEY, error_for

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _error_name(exc: Any) -> str | None:
    """The server's error class name from trailing metadata, if it sent one."""
    try:
        for key, value in exc.trailing_metadata() or ():
            if key == ERROR_METADATA_KEY:
                return str(value)
    except Exception:  # noqa: BLE001 - a transport failure carries no metadata
        return None
    return None


def _wake(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    """Completes ``future`` on its own loop (from the runtime thread)."""
    try:
        loop.call_soon_threadsafe(_set_done, future)
    except RuntimeError:  # the caller's loop is closed: nobody waits any more
        logger.debug("a caller's event loop closed before its call completed")


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():  # the waiter may have been cancelled meanwhile
        future.set_result(None)


def _read_outcome(future: asyncio.Future[Any]) -> None:
    """Marks ``future``'s exception as read, so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


class Job:
    """One coroutine submitted to the runtime loop: its result (``result``, a
    concurrent.futures.Future, for any thread), and a way to cancel it that leaves the result
    pending until the coroutine has unwound."""

    def __init__(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], jobs: set[Job],
                 notify: Callable[[], None] | None) -> None:
        self.result: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._loop = loop
        self._task: asyncio.Task[Any] | None = None
        self._jobs = jobs
        self._notify = notify  # called (on the runtime thread) once ``result`` is set
        loop.call_soon_threadsafe(self._start, coro)

    def _start(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._task = self._loop.create_task(coro)
        self._jobs.add(self)
        self._task.add_done_callback(self._settle)

    def _settle(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            self.fail(KVStoreError("the operation was cancelled"))
        elif task.exception() is not None:
            self.fail(task.exception())  # type: ignore[arg-type]
        else:
            self._complete(lambda: self.result.set_result(task.result()))

    def fail(self, exc: BaseException) -> None:
        """Completes the job with ``exc`` (also one whose coroutine never ended: close gave up on it)."""
        self._complete(lambda: self.result.set_exception(exc))

    def _complete(self, set_result: Callable[[], None]) -> None:
        self._jobs.discard(self)
        if self.result.done():
            return
        set_result()
        if self._notify is not None:
            self._notify()

    def cancel(self) -> None:
        """Cancels the coroutine (from any thread); ``result`` completes once it unwound."""
        self._loop.call_soon_threadsafe(self.cancel_here)  # after _start: call_soon runs in order

    def cancel_here(self) -> asyncio.Task[Any]:
        """``cancel`` on the runtime loop; returns the task, to wait for."""
        assert self._task is not None, "a job is listed only once started"
        self._task.cancel()
        return self._task


class Runtime:
    """The event loop thread and the gRPC channel of one client; see the module docstring.

    Thread-safe: ``call``, ``run`` and ``close`` may be used from any thread but the
    runtime's own (``call`` from its own loop just awaits)."""

    def __init__(self, address: str, timeout_s: float, token: str | None = None, tls: ClientTLS | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._token, self._tls = token, tls
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-io", daemon=True)
        self._jobs: set[Job] = set()
        self._lock = threading.Lock()  # orders submissions against close
        self._closed = False
        self.process = ProcessCheck()  # a forked child is refused (client/forked.py)
        self._channel: grpc.aio.Channel | None = None
        self.local: AsyncCallChannel | None = None  # the same-host call socket, when the client takes it (set on this loop)
        self.data: data_pb2_grpc.DataStub  # the stubs, set by open()
        self.directory: directory_pb2_grpc.DirectoryStub
        self.handoff: handoff_pb2_grpc.HandoffStub
        self.pages: PageStubs
        self._thread.start()

    # -- on the runtime loop ---------------------------------------------------------------

    async def open(self) -> None:
        """Opens the channel (on this loop: a grpc.aio channel belongs to the loop it was made on)."""
        self._channel = aio_channel(self.address, CLIENT_OPTIONS, token=self._token, tls=self._tls)
        self.data = data_pb2_grpc.DataStub(self._channel)
        self.directory = directory_pb2_grpc.DirectoryStub(self._channel)
        self.handoff = handoff_pb2_grpc.HandoffStub(self._channel)
        self.pages = PageStubs(self._channel)

    async def rpc(self, method: Callable[..., Awaitable[Any]], request: Any, timeout_s: float | None = None) -> Any:
        """Calls a unary (or stream-unary) method with a deadline (``timeout_s``, by default
        the client's); a gRPC failure raises the matching KVStoreError, the server's own where
        grpc.aio overwrote it (a stream refused while the client still wrote: kvstore/aio_status.py)."""
        call = method(request, timeout=timeout_s or self.timeout_s)
        kept = KeptStatus(call)
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise self.error(kept.instead_of(exc)) from None

    def method(self, name: str) -> Callable[..., Awaitable[Any]]:
        """The gRPC stub method of the unary method ``name`` ("Data.Allocate", "Handoff.Wait")."""
        service, method = name.split(".", 1)
        stubs = {"Data": self.data, "Directory": self.directory, "Handoff": self.handoff}
        return getattr(stubs[service], method)

    def error(self, exc: grpc.aio.AioRpcError) -> KVStoreError:
        """The kvstore error for a failed call: the class the server named, else the one of
        its status; a server that cannot be reached in time is a plain KVStoreError."""
        name = _error_name(exc)
        if name is None and exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return KVStoreError(f"kvstore-server at {self.address}: {exc.code().name}: {exc.details()}")
        return error_for(exc.code(), exc.details() or "", name)

    # -- from other loops and threads ------------------------------------------------------

    def _submit(self, coro: Coroutine[Any, Any, T], notify: Callable[[], None] | None = None) -> Job:
        if self.process.forked:
            coro.close()
            self.process.check(self.address)
        with self._lock:
            if self._closed:
                coro.close()
                raise KVStoreError(f"the client of kvstore-server at {self.address} is closed")
            return Job(self._loop, coro, self._jobs, notify)

    def on_loop(self) -> bool:
        """True when called from a coroutine running on the runtime loop."""
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` on the runtime loop and awaits it from the caller's loop. Cancelling
        the caller cancels the job and waits for it to unwind, so that no copy still writes
        into the caller's tensors and nothing it held stays leased once this returns."""
        if self.on_loop():
            return await coro
        loop = asyncio.get_running_loop()
        settled = loop.create_future()  # one wake-up of this loop when the job is done
        job = self._submit(coro, lambda: _wake(loop, settled))
        try:
            await settled
        except asyncio.CancelledError:
            job.cancel()
            unwound = asyncio.wrap_future(job.result)
            unwound.add_done_callback(_read_outcome)  # the caller left: what the job ended with is nobody's to raise
            await asyncio.wait([unwound])
            raise
        return job.result.result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Job:
        """Runs ``coro`` on the runtime loop and returns at once: for a caller with a bound
        of its own that must not wait for a cancelled call to unwind (an engine hook on a
        store that stopped answering). It waits on ``job.result`` as long as it chooses and
        may ``job.cancel()`` without waiting; the coroutine's cleanup (a late lease given
        back) then runs on the loop. ``close`` cancels and waits for it like any other job."""
        return self._submit(coro)

    def detach(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Runs ``coro`` on the runtime loop for its effect alone (a best-effort notice to the
        node): its outcome is read and dropped; nothing runs once the runtime closed."""
        try:
            self._submit(coro).result.add_done_callback(lambda done: done.cancelled() or done.exception())
        except KVStoreError:  # closed: _submit closed the coroutine
            pass

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Runs ``coro`` on the runtime loop and blocks this thread (never the runtime's own)
        until it is done. Past ``timeout_s`` the job is cancelled, waited for (its cleanup
        RPCs have deadlines of their own) and KVStoreError raised."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("Runtime.run called on the runtime thread: it would wait for itself")
        job = self._submit(coro)
        try:
            return job.result.result(max(0.0, timeout_s))
        except concurrent.futures.TimeoutError:
            job.cancel()
            concurrent.futures.wait([job.result], self.timeout_s)
            raise KVStoreError(f"no answer from kvstore-server at {self.address} within {timeout_s:.3f} s") from None

    def close(self) -> None:
        """Cancels the jobs still running and waits for them to unwind, closes the channel and
        stops the loop. Idempotent; later calls and runs raise KVStoreError."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("Runtime.close called on the runtime thread: it would wait for itself")
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.process.forked:
            return  # the loop's selector and self-pipe are the parent's too: closing them would unregister its sockets
        if self._thread.is_alive():
            done = concurrent.futures.Future[None]()
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._shutdown()).add_done_callback(
                lambda task: done.set_result(None)))
            done.result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    async def _shutdown(self) -> None:
        jobs = list(self._jobs)
        tasks = [job.cancel_here() for job in jobs]
        if tasks:  # their cleanup (aborts, releases) still has the channel; each RPC has a deadline
            _, pending = await asyncio.wait(tasks, timeout=2 * self.timeout_s)
            for job, task in zip(jobs, tasks):
                if task in pending:
                    logger.error("a call did not finish its cleanup within %.0f s of close; what it holds expires",
                                 2 * self.timeout_s)
                    job.fail(KVStoreError("the client closed before the operation finished"))
        if self.local is not None:
            await self.local.close()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
