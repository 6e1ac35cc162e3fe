"""Sessions on the vLLM connector, scheduler side: a request's tokens logged at its node, so that
a live migration (DESIGN §12.8) can move it to another instance while it runs.

More: client/adapters/vllm/README.md (### sessions.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.scheduler import SchedulerSide
from kvstore.client.client import KVStoreClient
from kvstore.errors import KVStoreError, SessionFenced, TierUnavailable

logger = logging.getLogger(__name__)

SESSION_KEY = "kvstore_session_id"  # in a request's kv_transfer_params
STOP_REASON = "kvstore_session_moved"  # the stop_reason of a request stopped by its session's fence
RETRY_S = 10.0  # how long one append is asked again of a node that cannot take it now


@dataclass
class SessionStats:
    """Counters tests and logs read (never reset)."""

    started: int = 0  # requests that began a session's log
    continued: int = 0  # requests that continued a logged session (a moved one, at its target)
    not_logged: int = 0  # named a session whose log could not be read or does not lead the prompt
    appended_tokens: int = 0
    append_failed: int = 0  # appends that failed other than by a fence (sent again)
    fenced: int = 0  # requests stopped: their session moved
    resumed_tokens: int = 0  # prompts of continued sessions, when first scheduled
    resumed_cached_tokens: int = 0  # of those, not computed: kvstore's load (and vLLM's own cache)
    resumed_computed_tokens: int = 0  # of those, computed by the prefill


@dataclass
class Session:
    request: Any  # vLLM's request: all_token_ids grows with the generated tokens
    session_id: str
    logged: int  # the log's length as last answered
    prompt_tokens: int  # a new session's prompt length (its first append says it); 0 when continued
    continued: bool = False
    job: Any = None  # the append in flight (the runtime's Job)
    client: KVStoreClient | None = None  # the job's
    fenced: bool = False
    closed: bool = False  # nothing more is sent: fenced, given up, or its log is not what it was
    scheduled: bool = False  # its first step was counted
    keep_until: float = math.inf  # finished: how long its last tokens are sent again (then given up, logged)

    def pending(self) -> bool:
        """An append in flight, or tokens to send (not fenced, not given up on)."""
        if self.job is not None:
            return True
        unsent = not self.closed and len(self.request.all_token_ids) > self.logged
        if unsent and time.monotonic() > self.keep_until:
            logger.error("kvstore: the last %d tokens of request %s were not logged to session %s (given up)",
                         len(self.request.all_token_ids) - self.logged, self.request.request_id, self.session_id)
            self.closed = True
            return False
        return unsent


@dataclass
class SessionLogs:
    """The sessions of the requests in flight; every method runs on vLLM's scheduler thread."""

    store: StoreConnection
    scheduler: SchedulerSide
    read_timeout_s: float
    stats: SessionStats = field(default_factory=SessionStats)

    def __post_init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._tails: list[Session] = []  # finished requests whose last append is in flight

    def begin(self, request: Any) -> None:
        """A new request: reads the log of the session it names, if any (see the module docstring)."""
        params = request.kv_transfer_params or {}
        session_id = params.get(SESSION_KEY)
        if not session_id:
            return
        if params.get("do_remote_decode"):  # the decode instance generates and logs it: one log, one owner
            return self._not_logged(request, session_id, "a disaggregated prefill: its decode instance logs it")
        tokens = list(request.prompt_token_ids or ())
        client = self.store.client()
        if client is None or not isinstance(session_id, str) or not tokens:
            return self._not_logged(request, session_id, "no store connected, no prompt ids, or not a string")
        try:
            session_id.encode()
        except UnicodeEncodeError:  # the sender's: a lone surrogate (JSON's "\ud800") is not UTF-8
            return self._not_logged(request, session_id, "not UTF-8")
        if any(s.session_id == session_id and not s.closed for s in self._sessions.values()):
            # one writer per session: both at one length, the later one's tokens entered its log and the
            # request that logs it was logged no more (a migration would continue the other's)
            return self._not_logged(request, session_id, "another request of this instance logs it")
        started = time.monotonic()
        in_flight = [t.job.result for t in self._tails if t.session_id == session_id and t.job is not None]
        if in_flight:  # a request of S that finished: its last append first (else this one's, at the length read, is a gap)
            concurrent.futures.wait(in_flight, self.read_timeout_s)
        try:
            logged = self.store.run(client, client.read_session(session_id),
                                    max(0.0, self.read_timeout_s - (time.monotonic() - started)))
        except (KVStoreError, TimeoutError) as exc:
            self.store.failed(client, exc)
            return self._not_logged(request, session_id, f"its log could not be read: {exc}")
        if logged is None:
            session = Session(request, session_id, 0, len(tokens))
            self.stats.started += 1
        elif tokens[: len(logged.tokens)] == logged.tokens:
            session = Session(request, session_id, len(logged.tokens), 0, continued=True)
            self.stats.continued += 1
        else:
            return self._not_logged(request, session_id, f"the prompt does not begin with its log ({len(logged.tokens)} tokens)")
        self._sessions[request.request_id] = session
        self._send(session, None)

    def _not_logged(self, request: Any, session_id: object, why: str) -> None:
        self.stats.not_logged += 1
        logger.error("kvstore: request %s names session %.80r, which is not logged (%s): served as any request",
                     request.request_id, session_id, why)  # the sender's id: its first characters

    def attach(self, req_id: str) -> None:
        """Once the scheduler side tracks the request (its lookup): its saves name its session, a
        fenced one saves nothing (scheduler.py)."""
        session, state = self._sessions.get(req_id), self.scheduler.requests.get(req_id)
        if session is not None and state is not None:
            state.session_id, state.fenced = session.session_id, session.fenced

    def step(self, scheduler_output: Any) -> None:
        """Each step, once its saves are planned (build_connector_meta): settles the appends that
        ended (a fence stops the request's saves from the next step on), sends the tokens generated
        since, and counts a continued session's first prefill."""
        for new in scheduler_output.scheduled_new_reqs:
            session = self._sessions.get(new.req_id)
            if session is not None and session.continued and not session.scheduled:
                session.scheduled = True
                prompt = len(session.request.prompt_token_ids)
                self.stats.resumed_tokens += prompt
                self.stats.resumed_cached_tokens += new.num_computed_tokens
                self.stats.resumed_computed_tokens += prompt - new.num_computed_tokens
        for session in [*self._sessions.values(), *self._tails]:
            if session.job is not None and session.job.result.done():
                self._settle(session)
            if session.job is None and not session.closed:
                self._send(session, None)  # a finished request's last append that failed: again
        self._tails = [s for s in self._tails if s.pending()]

    def _send(self, session: Session, after: Any) -> None:
        """Appends what the request holds past the log (``after``: an append in flight, waited for first)."""
        tokens = session.request.all_token_ids
        client = self.store.client()
        if client is None or len(tokens) <= session.logged:
            return
        start = session.logged
        prompt_tokens = session.prompt_tokens if start == 0 else 0
        session.client = client
        try:
            session.job = client.runtime.submit(self._append(client, session.session_id, after, list(tokens[start:]), start,
                                                             prompt_tokens))
        except KVStoreError as exc:  # the client closed under us: the next step sends them with the next one
            self.store.failed(client, exc)
            session.job = after

    @staticmethod
    async def _append(client: KVStoreClient, session_id: str, after: Any, tokens: list[int], start: int,
                      prompt_tokens: int) -> int:
        """Appends ``tokens`` (the request's from position ``start``) past what the log holds: the
        append ``after`` may have logged some of them (a retry of logged tokens changes nothing).
        A node that cannot take it now (not caught up with the cluster, or not answering) is asked
        again for RETRY_S: a finished request's last append has no next step to be sent again in."""
        if after is not None:
            try:
                held = await asyncio.wrap_future(after.result)
                tokens, start = tokens[held - start :], held
            except SessionFenced:
                raise
            except KVStoreError:
                pass  # not logged: all of them again
        if not tokens:
            return start
        give_up_at, pause_s = time.monotonic() + RETRY_S, 0.02
        while True:
            try:
                return await client.append_tokens(session_id, tokens, expected_length=start, sync=True,
                                                  prompt_tokens=prompt_tokens if start == 0 else 0)
            except KVStoreError as exc:  # KVStoreError itself: the transport's
                if type(exc) not in (TierUnavailable, KVStoreError) or time.monotonic() + pause_s > give_up_at:
                    raise
            await asyncio.sleep(pause_s)
            pause_s = min(0.5, pause_s * 2)

    def _settle(self, session: Session) -> None:
        job, session.job = session.job, None
        exc = job.result.exception()
        if exc is None:
            length = int(job.result.result())
            self.stats.appended_tokens += max(0, length - session.logged)
            session.logged = max(session.logged, length)
        elif isinstance(exc, SessionFenced):
            self._fence(session, exc)
        elif isinstance(exc, KVStoreError) and type(exc) not in (KVStoreError, TierUnavailable):
            session.closed = True  # the node refused it (a gap: the log was ended meanwhile; a quota): not sent again
            logger.error("kvstore: session %s of request %s is no longer logged: %s", session.session_id,
                         session.request.request_id, exc)
        else:
            self.stats.append_failed += 1
            logger.warning("kvstore: append to session %s failed (sent again): %s", session.session_id, exc)
            if session.client is not None:
                self.store.failed(session.client, exc)

    def _fence(self, session: Session, why: object) -> None:
        if session.fenced or session.request.request_id not in self._sessions:  # a finished request's last append
            if not session.fenced:
                logger.warning("kvstore: session %s moved (%s) before the last tokens of request %s were logged",
                               session.session_id, why, session.request.request_id)
            session.fenced = session.closed = True
            return
        session.fenced = session.closed = True
        self.stats.fenced += 1
        request = session.request
        request.max_tokens = min(request.max_tokens, request.num_output_tokens)  # vLLM's stop check ends it
        request.stop_reason = STOP_REASON
        self.attach(request.request_id)
        logger.warning("kvstore: session %s moved (%s): request %s stops here after %d tokens, %d of them logged",
                       session.session_id, why, request.request_id, request.num_output_tokens,
                       max(0, session.logged - len(request.prompt_token_ids)))

    def saves_refused(self, req_ids: set[str]) -> None:
        """The workers' saves of these requests were refused by a fence (worker.py)."""
        for req_id in req_ids:
            session = self._sessions.get(req_id)
            if session is not None:
                self._fence(session, "a save was refused")

    def finished(self, request: Any) -> None:
        """``request_finished``: its last tokens are appended, after the append in flight (one
        that fails is sent again in a later step, or by ``flush``)."""
        session = self._sessions.pop(request.request_id, None)
        if session is None or session.closed:
            return
        if session.job is not None and session.job.result.done():
            self._settle(session)
        if session.closed:
            return
        in_flight, session.job = session.job, None
        self._send(session, in_flight)
        session.job = session.job or in_flight
        session.keep_until = time.monotonic() + 6 * RETRY_S
        self._tails.append(session)

    def flush(self, timeout_s: float) -> bool:
        """Appends every token the requests hold and waits for it (at most ``timeout_s``): the
        engine's loop does this step by step; a runner that stops stepping (a test pausing a
        generation before it migrates the session) calls it. False on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            for session in [*self._sessions.values(), *self._tails]:
                if session.job is None and not session.closed:
                    self._send(session, None)
            pending = [s for s in [*self._sessions.values(), *self._tails] if s.job is not None]
            if not pending:
                return not any(s.pending() for s in [*self._sessions.values(), *self._tails])
            for session in pending:
                try:
                    session.job.result.result(max(0.0, deadline - time.monotonic()))
                except concurrent.futures.TimeoutError:
                    return False
                except KVStoreError:
                    pass  # settled below
                self._settle(session)
            self._tails = [s for s in self._tails if s.pending()]
            if time.monotonic() >= deadline:
                return False
