"""The connector's sessions (client/adapters/vllm/sessions.py) without an engine, against a real
kvstore-server process: what a request naming a session logs, step by step and when it ends, how
a prompt that begins with the log continues it, and which requests stay unlogged. vLLM's requests
are stand-ins with the attributes the connector reads (as in test_vllm_connector_parts). The
fence, which needs a cluster, is exercised on real engines in test_vllm_pd.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from support.servers import ServerProcess
from test_vllm_connector_parts import BLOCK, LAYOUT, parts, store_process

from kvstore import Namespace
from kvstore.client import KVStoreClient
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.scheduler import SchedulerSide
from kvstore.client.adapters.vllm.sessions import SessionLogs
from kvstore.client.session import LoggedSession

__all__ = ["store_process"]  # the fixture, used by name

NO_STEP = SimpleNamespace(scheduled_new_reqs=[])


def request(req_id: str, prompt: list[int], session_id: str | None) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, all_token_ids=list(prompt), max_tokens=64,
                           num_output_tokens=0, stop_reason=None,
                           kv_transfer_params={"kvstore_session_id": session_id} if session_id else None)


def scheduled(req: SimpleNamespace, cached: int) -> SimpleNamespace:
    """A step that schedules ``req`` for the first time with ``cached`` of its tokens not computed."""
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, num_computed_tokens=cached)])


def generate(sessions: SessionLogs, req: SimpleNamespace, tokens: list[int]) -> None:
    """Decode steps: one token each, the connector's hook after each."""
    for token in tokens:
        req.all_token_ids.append(token)
        req.num_output_tokens += 1
        sessions.step(NO_STEP)


def read(address: str, session_id: str, store: StoreConnection) -> LoggedSession | None:
    async def run() -> LoggedSession | None:
        async with KVStoreClient(address, store.namespace) as client:
            return await client.read_session(session_id)
    return asyncio.run(run())


def test_a_sessions_tokens_are_logged_and_its_log_continued(store_process: ServerProcess) -> None:
    """A new session's prompt is its log's prompt; each step's tokens and, when the request
    ends, its last ones follow. Its saves name the session. A later request whose prompt begins
    with the log continues it (the target instance's case): the tokens past the log are appended
    and its first step is counted as resumed. One whose prompt does not is served unlogged."""
    store, scheduler, _, _ = parts(store_process.address)
    sessions = SessionLogs(store, scheduler, read_timeout_s=5.0)
    try:
        prompt = list(range(11, 11 + 2 * BLOCK + 1))
        first = request("r1", prompt, "s1")
        sessions.begin(first)
        scheduler.num_new_matched_tokens(first, 0)
        sessions.attach("r1")
        assert scheduler.requests["r1"].session_id == "s1"
        generate(sessions, first, list(range(500, 520)))
        sessions.finished(first)
        assert sessions.flush(10)
        logged = read(store_process.address, "s1", store)
        assert logged is not None and logged.prompt_tokens == len(prompt)
        assert logged.tokens == prompt + list(range(500, 520))
        assert sessions.stats.started == 1 and sessions.stats.appended_tokens == len(prompt) + 20

        again = request("r2", [*logged.tokens, 7, 8], "s1")  # the client showed two tokens the log lacks
        sessions.begin(again)
        sessions.step(scheduled(again, 3 * BLOCK))
        generate(sessions, again, [9])
        sessions.finished(again)
        assert sessions.flush(10)
        resumed = read(store_process.address, "s1", store)
        assert resumed is not None and resumed.tokens == [*logged.tokens, 7, 8, 9] and resumed.prompt_tokens == len(prompt)
        stats = sessions.stats
        assert (stats.continued, stats.resumed_tokens, stats.resumed_cached_tokens) == (1, len(again.prompt_token_ids), 3 * BLOCK)
        assert stats.resumed_computed_tokens == len(again.prompt_token_ids) - 3 * BLOCK

        other = request("r3", [3] * 80, "s1")
        sessions.begin(other)
        generate(sessions, other, [4])
        sessions.finished(other)
        assert sessions.flush(10) and sessions.stats.not_logged == 1
        assert read(store_process.address, "s1", store) == resumed
        assert sessions.stats.append_failed == 0 and sessions.stats.fenced == 0
    finally:
        store.close()


def test_without_a_store_a_session_is_served_unlogged() -> None:
    """No store to read the log from: the request goes on as any request (no stall, no error)."""
    store = StoreConnection("127.0.0.1:1", Namespace(model="parts", revision="r", layout=LAYOUT), connect_timeout_s=0.1)
    sessions = SessionLogs(store, SchedulerSide(store, BLOCK, lookup_timeout_s=0.1), read_timeout_s=0.1)
    try:
        req = request("r", list(range(1, 40)), "s")
        sessions.begin(req)
        generate(sessions, req, [1, 2])
        sessions.finished(req)
        assert sessions.stats.not_logged == 1 and sessions.flush(1)
    finally:
        store.close()


def test_a_log_ended_under_a_request_is_not_written_again(store_process: ServerProcess) -> None:
    """The session's log is ended while its request runs: the next append is refused (a gap),
    and no more are sent (no error every step); the request goes on."""
    store, scheduler, _, _ = parts(store_process.address)
    sessions = SessionLogs(store, scheduler, read_timeout_s=5.0)
    try:
        req = request("r", list(range(1, 40)), "s2")
        sessions.begin(req)
        assert sessions.flush(10)

        async def end() -> None:
            async with KVStoreClient(store_process.address, store.namespace) as client:
                await client.end_session("s2")
        asyncio.run(end())
        generate(sessions, req, [1, 2])
        assert sessions.flush(10)
        generate(sessions, req, [3])
        sessions.finished(req)
        assert sessions.flush(10)
        assert read(store_process.address, "s2", store) is None
        assert (sessions.stats.append_failed, sessions.stats.fenced, req.max_tokens) == (0, 0, 64)
    finally:
        store.close()
