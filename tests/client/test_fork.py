"""A client connected before a fork (an engine that forks its workers after it connected):
the child gets a clear KVStoreError at once, never the parent's connections (their answers
would be read by whichever process reads first) and never a wait for the I/O runtime's
thread, which a child does not have; the parent's client goes on unharmed, the child's
close() included."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import time
from typing import Any

import pytest
import torch
from support.kv import random_kv
from support.servers import ServerProcess

from kvstore import KVLayout, Namespace
from kvstore._proto import directory_pb2
from kvstore.client import KVStoreClient
from kvstore.client.calls import Calls
from kvstore.errors import KVStoreError


def _child(client: KVStoreClient, calls: Calls, tokens: list[int], kv: torch.Tensor, hit: Any,
           write: int) -> None:
    """In the forked child: every kind of call, each answered within 5 s; the outcome of each
    (the exception's type and message, or "ok", or "hung") written to the pipe as it comes."""

    class Outcomes:
        def append(self, line: str) -> None:
            os.write(write, (line + "\n").encode())

    outcomes = Outcomes()

    async def attempt(coro: Any) -> str:
        try:
            await asyncio.wait_for(coro, 5)
        except KVStoreError as exc:
            return f"{type(exc).__name__}: {exc}"
        except TimeoutError:
            return "hung"
        except Exception as exc:  # noqa: BLE001 - reported, judged by the parent
            return f"other {type(exc).__name__}: {exc}"
        return "ok"

    async def main() -> None:
        outcomes.append(await attempt(client.put([t + 7 for t in tokens], kv)))
        outcomes.append(await attempt(client.lookup(tokens)))
        outcomes.append(await attempt(client.get(hit, torch.zeros_like(kv))))
        outcomes.append(await attempt(client.close()))

    try:
        asyncio.run(main())
        request = directory_pb2.LookupRequest(namespace_id=client.namespace.namespace_id, keys=client.keys(tokens))
        calls.call("Directory.Lookup", request, 5)  # from a thread: the blocking channel
        outcomes.append("ok")
    except KVStoreError as exc:
        outcomes.append(f"{type(exc).__name__}: {exc}")
    except BaseException as exc:  # noqa: BLE001
        outcomes.append(f"other {type(exc).__name__}: {exc}")
    os._exit(0)


def _lines_until_eof(fd: int, timeout_s: float) -> list[str]:
    got = b""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        got += chunk
    return got.decode().splitlines()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # os.fork() of a process with threads: the point
def test_a_forked_child_is_refused_at_once_and_the_parent_goes_on(server_process: ServerProcess, ns: Namespace,
                                                                  layout: KVLayout) -> None:
    server_process.start()
    loop = asyncio.new_event_loop()
    client = KVStoreClient(server_process.address, ns)
    try:
        loop.run_until_complete(client.connect())
        tokens = list(range(layout.page_tokens * 2))
        kv = random_kv(layout, len(tokens))
        assert loop.run_until_complete(client.put(tokens, kv)) == len(tokens)
        hit = loop.run_until_complete(client.lookup(tokens))  # the parent's loop channel is open now
        assert client.calls.blocking is not None, "a same-host client has its blocking call channel"
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            _child(client, client.calls, tokens, kv, hit, write)
        os.close(write)
        outcome = _lines_until_eof(read, 60)
        if len(outcome) < 5:
            os.kill(pid, signal.SIGKILL)
            outcome.append("(the child was killed after 60 s)")
        os.close(read)
        os.waitpid(pid, 0)
        assert len(outcome) == 5, outcome
        for line in outcome[:3] + outcome[4:]:  # put, lookup, get; the blocking channel's call
            assert line.startswith("KVStoreError") and "fork" in line, outcome
        assert outcome[3] == "ok", f"close() in the child: {outcome[3]}"
        # the parent's connections were not touched by the child
        again = loop.run_until_complete(client.lookup(tokens))
        into = torch.zeros_like(kv)
        assert loop.run_until_complete(client.get(again, into)) == len(tokens) and torch.equal(into, kv)
        assert client.calls.blocking is not None
    finally:
        loop.run_until_complete(client.close())
        loop.close()
