"""The connector's sessions (sessions.py, resave.py) under the cases a review found: a finished
request's save again after its session moved, two requests of one instance naming one session,
and a session's next turn arriving while the last append of the turn before waits at the node.
Without an engine, against a real kvstore server (the fence is written into the server's
owner records, as tests/server/test_migration_calls.py does)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from test_vllm_connector_parts import BLOCK, parts
from test_vllm_sessions_parts import generate, read, request

from kvstore.client import KVStoreClient
from kvstore.client.adapters.vllm.connector import KVStoreConnector
from kvstore.client.adapters.vllm.metadata import KVStoreConnectorMetadata, SaveSpec
from kvstore.client.adapters.vllm.pd import HandoffScheduler
from kvstore.client.adapters.vllm.sessions import SessionLogs
from kvstore.errors import KVStoreError
from kvstore.server.session_owners import FENCED, FREEZING, OWNED, Ownership


def _stored_pages(address: str, store: object, tokens: list[int]) -> int:
    async def run() -> int:
        async with KVStoreClient(address, store.namespace) as client:  # type: ignore[attr-defined]
            return (await client.lookup(tokens)).num_pages
    return asyncio.run(run())


def test_a_finished_requests_save_again_names_its_session_so_a_fence_refuses_it(server) -> None:
    """A save of a session's request could not start (no store for a moment); the session then
    moved (fenced here). When the request finishes, the worker saves its pages again: that save
    must name the session, so that the fence refuses it, as it refuses every save of the request
    (README: nothing of it is saved there again). It was made without the session, and stored."""
    store, _, worker, _ = parts(server.address)
    try:
        store.retry_s = 0.05
        tokens = list(range(1, 2 * BLOCK + 1))
        client = store.client()
        assert client is not None
        namespace_id = client.namespace.namespace_id
        closing = store.failed(client, KVStoreError("dropped by the test"))
        assert closing is not None and store.client() is None
        closing.join(5)
        spec = SaveSpec("r", tokens, [0, 1], 0, "s")
        worker.begin_step(KVStoreConnectorMetadata(saves=[spec], num_scheduled_tokens=len(tokens)))
        worker.end_step()
        assert worker.report() is not None  # the save ended short: the scheduler side is told

        server.session_owners.put(namespace_id, "s", Ownership(1, FENCED, "n2"))  # the session moved meanwhile
        deadline = time.monotonic() + 5
        while store.client() is None:
            assert time.monotonic() < deadline, "the store did not reconnect"
            time.sleep(0.02)
        reported = worker.finished({"r"})
        while "r" not in reported:
            assert time.monotonic() < deadline, "the finished request was not reported"
            time.sleep(0.02)
            reported = worker.finished(set())
        assert worker.stats.saves_again == 1
        assert _stored_pages(server.address, store, tokens) == 0, "a save of the moved session was stored after the fence"
        assert worker.stats.saves_fenced == 1
    finally:
        store.close()


def test_a_second_request_naming_a_session_another_request_logs_is_not_logged(server) -> None:
    """A request names session S while another request of this instance logs S (a client's retry,
    or anyone who names S): the second is served unlogged. Both logging it raced their appends at
    one length: the second's tokens entered S's log, and the first, the session's own request, was
    no longer logged (what a migration would then continue is the second's)."""
    store, scheduler, _, _ = parts(server.address)
    sessions = SessionLogs(store, scheduler, read_timeout_s=5.0)
    try:
        prompt = list(range(11, 11 + BLOCK + 3))
        first = request("r1", prompt, "s")
        sessions.begin(first)
        assert sessions.flush(10)
        second = request("r2", list(prompt), "s")
        sessions.begin(second)
        generate(sessions, second, [600, 601])
        assert sessions.flush(10)
        generate(sessions, first, [500, 501, 502])
        assert sessions.flush(10)
        logged = read(server.address, "s", store)
        assert logged is not None and logged.tokens == [*prompt, 500, 501, 502]
        assert (sessions.stats.started, sessions.stats.continued, sessions.stats.not_logged) == (1, 0, 1)
        sessions.finished(second)
        sessions.finished(first)
        assert sessions.flush(10)
    finally:
        store.close()



def test_a_follow_up_that_arrives_while_the_last_append_waits_at_the_node_is_logged(server) -> None:
    """A request of session S finishes; its last tokens' append waits at the node (the token log
    is busy: held here, as a large append of another session holds it). The next turn of S arrives
    meanwhile, its prompt the conversation so far and a new message. It read the log without the
    last tokens, its first append went in behind the waiting one at the length it read, and was
    refused as a gap: the new turn was not logged at all. It must read the log once the append in
    flight ended."""
    store, scheduler, _, _ = parts(server.address)
    sessions = SessionLogs(store, scheduler, read_timeout_s=5.0)
    try:
        prompt = list(range(11, 11 + BLOCK + 3))
        first = request("a", prompt, "s")
        sessions.begin(first)
        generate(sessions, first, [500])
        assert sessions.flush(10)
        first.all_token_ids += [700, 701, 702]  # the last steps' tokens: appended once it finished
        lock = server.wal._lock
        lock.acquire()  # the log busy with another session's append
        try:
            sessions.finished(first)
            time.sleep(0.2)  # that append waits at the node
            threading.Timer(0.3, lock.release).start()
        except BaseException:
            lock.release()
            raise
        turn = request("b", [*first.all_token_ids, 9, 9], "s")
        sessions.begin(turn)
        generate(sessions, turn, [800])
        sessions.finished(turn)
        assert sessions.flush(10)
        logged = read(server.address, "s", store)
        assert logged is not None and logged.tokens == [*first.all_token_ids, 9, 9, 800]
        assert sessions.stats.not_logged == 0
    finally:
        store.close()


def test_a_session_id_that_cannot_be_sent_is_served_unlogged_not_raised(server) -> None:
    """``kv_transfer_params`` come from the request's sender: a session id with a lone surrogate
    (valid in a Python str, as JSON's "\\ud800" decodes) cannot be encoded for the node. The hook
    raised UnicodeEncodeError into vLLM's add_request; the request must be served unlogged, the
    connection kept. A too long id is the node's refusal, also unlogged."""
    store, scheduler, _, _ = parts(server.address)
    sessions = SessionLogs(store, scheduler, read_timeout_s=5.0)
    try:
        client = store.client()
        for i, sid in enumerate(["\ud800", "s" * 5000]):
            req = request(f"r{i}", list(range(1, 40)), sid)
            sessions.begin(req)
            generate(sessions, req, [1])
            sessions.finished(req)
        assert sessions.flush(5) and sessions.stats.not_logged == 2
        assert store.client() is client  # not dropped: nothing failed on the way
    finally:
        store.close()


def test_a_decode_requests_session_names_its_saves(server) -> None:
    """A disaggregated decode (do_remote_prefill) that names a session: the connector's hooks
    (KVStoreConnector's own, its scheduler side without an engine) log it, and its saves must name
    the session, so that a fence refuses them as any session request's. The decode's handoff path
    returned before the session was attached: its saves named none, and the node stored them
    after a move until an append's refusal stopped the request."""
    store, scheduler, _, _ = parts(server.address)
    connector = object.__new__(KVStoreConnector)  # its scheduler role, without vLLM's config
    connector.store, connector.scheduler, connector.hybrid, connector._warned_sessions = store, scheduler, False, False
    connector.handoffs = HandoffScheduler(scheduler, deadline_s=10.0, ttl_s=30.0)
    connector.sessions = SessionLogs(store, scheduler, read_timeout_s=5.0)
    try:
        prompt = list(range(1, 4 * BLOCK + 2))
        req = request("d", prompt, "s")
        req.kv_transfer_params.update(do_remote_prefill=True, kvstore_handoff_id="ab" * 16, kvstore_num_tokens=4 * BLOCK)
        connector.on_new_request(req)
        assert connector.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, True)
        connector.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],)), 4 * BLOCK)
        assert scheduler.requests["d"].session_id == "s"
    finally:
        connector.sessions.flush(5)
        store.close()


def test_a_fence_that_is_aborted_does_not_stop_the_request(server) -> None:
    """A migration writes FREEZING at the source before etcd decides; an append meanwhile is refused
    with a retryable TierUnavailable. Bug: it was SessionFenced ("being fenced"), which the connector
    takes as final: when etcd then decided for the source (the fence aborted: etcd unreachable, the
    CAS lost), the source owned the session again, but its request had been cut (finish reason
    length, stop reason kvstore_session_moved) and no instance continued it."""
    store, scheduler, _, _ = parts(server.address)
    sessions = SessionLogs(store, scheduler, read_timeout_s=5.0)
    try:
        req = request("r", list(range(1, 40)), "s")
        sessions.begin(req)
        assert sessions.flush(10)
        namespace_id = store.client().namespace.namespace_id  # type: ignore[union-attr]
        server.session_owners.put(namespace_id, "s", Ownership(0, FREEZING, "n2"))
        generate(sessions, req, [1])
        sessions.flush(2)
        server.session_owners.put(namespace_id, "s", Ownership(1, OWNED, server.config.node))  # the fence aborted
        generate(sessions, req, [2, 3])
        assert sessions.flush(10)
        assert req.max_tokens == 64 and req.stop_reason is None, "the request was stopped by a fence that did not happen"
        logged = read(server.address, "s", store)
        assert logged is not None and logged.tokens == [*range(1, 40), 1, 2, 3]
    finally:
        store.close()


def test_a_disaggregated_prefill_naming_a_session_does_not_log_it(server) -> None:
    """A router that sends kvstore_session_id with do_remote_decode made the prefill instance log the
    session at its node beside the decode instance's log at another: two logs, two owners of one session.
    The prefill leaves the session to the decode, which generates its tokens."""
    store, scheduler, _, _ = parts(server.address)
    sessions = SessionLogs(store, scheduler, read_timeout_s=5.0)
    try:
        req = request("p", list(range(1, 40)), "pd-session")
        req.kv_transfer_params = {**req.kv_transfer_params, "do_remote_decode": True, "do_remote_prefill": False}
        sessions.begin(req)
        generate(sessions, req, [1])
        assert sessions.flush(10)
        assert read(server.address, "pd-session", store) is None, "the prefill instance logged the session"
        assert sessions.stats.not_logged == 1
    finally:
        store.close()
