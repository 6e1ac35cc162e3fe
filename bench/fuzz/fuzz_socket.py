"""kvstore-bench fuzz, the same-host call socket (kvstore/callsocket/frames.py): the fuzzer's own
structure-aware requests (valid, field-mutated, encoding-damaged, random) of the methods the
socket serves, sent as frames, and the frames themselves damaged: a lying length (cut short,
or longer than what follows), a random method id or deadline, random bytes, a request of
another caller's connection. Callers are those of the gRPC run: the tenants and the admin say
HELLO with their tokens; callers without a valid token must be refused at HELLO.

Violations, tallied with the gRPC run's: an INTERNAL or UNKNOWN answer, an answer that does
not come within CALL_TIMEOUT_S (a hang), a bad caller let in, a server that dies.
"""

from __future__ import annotations

import random
import socket
from typing import Any

import grpc
from google.protobuf import message_factory

from kvstore._proto import data_pb2, directory_pb2
from kvstore.bench.fuzz.fuzz_calls import BAD_CALLERS, CALL_TIMEOUT_S, Case
from kvstore.bench.fuzz.fuzz_cases import learn
from kvstore.bench.fuzz.fuzz_mutate import random_bytes
from kvstore.callsocket import frames

_CODES = {int(code.value[0]): code.name for code in grpc.StatusCode}
_SERVICES = {"Data": data_pb2.DESCRIPTOR.services_by_name["Data"], "Directory": directory_pb2.DESCRIPTOR.services_by_name["Directory"]}
CLOSED = "closed by the server"


class SocketFuzzer:
    """Runs cases of ``fuzzer`` (fuzz.Fuzzer: cases, tally, pools) over the call socket at ``path``."""

    def __init__(self, path: str, fuzzer: Any, seed: int) -> None:
        self.path = path
        self.fuzzer = fuzzer
        self.rng = random.Random(seed + 15)
        self._open: dict[str, socket.socket] = {}  # token -> a connection that said HELLO with it
        # The run's methods the socket serves: none (--methods Replicate) skips the phase. Cases were
        # drawn until one was served, which never ended, and SIGTERM waited for this thread.
        self.methods = [m for m in fuzzer.methods if f"{m[1].containing_service.name}.{m[1].name}" in frames.METHOD_IDS]

    def run(self, num_calls: int, bar: Any, server_alive: Any) -> None:
        for _ in range(num_calls if self.methods else 0):
            if not server_alive():
                return
            self.one(self._next_case())
            bar.update(1)
        for conn in self._open.values():
            conn.close()

    def _next_case(self) -> Case:
        return self.fuzzer.next_case(self.methods)

    def one(self, case: Case) -> None:
        name = f"socket:{case.method.name}"
        tally = self.fuzzer.tally
        tally.calls[name] += 1
        tally.messages[name] += 1
        method_id = frames.METHOD_IDS[f"{case.method.containing_service.name}.{case.method.name}"]
        frame, strategy, close_after_send, sent_id = self._frame(method_id, case.requests[0])
        tally.strategies[f"socket {strategy}"] += 1
        try:
            conn, hello = self._connection(case)
            if hello != "OK":
                code = hello
            else:
                conn.sendall(frame)
                if close_after_send:
                    conn.shutdown(socket.SHUT_WR)  # nothing more comes: a frame cut short is seen as such at once
                answer = _read_answer(conn)
                code = CLOSED if answer is None else _CODES.get(answer[0], f"status {answer[0]}")
                if answer is None or close_after_send:
                    self._drop(case)
                if answer is not None and answer[0] == 0 and 0 < sent_id <= len(frames.METHODS):
                    self._learn(case, frames.METHODS[sent_id - 1], answer[1], strategy == "as is")
        except TimeoutError:
            code = "HANG"
            self._drop(case)
            tally.violations.append(f"{name}: no answer within {CALL_TIMEOUT_S} s for {strategy} ({case.strategy})")
        except OSError:  # the server closed first (it answered a bad frame and dropped the connection)
            code = CLOSED
            self._drop(case)
        tally.codes[name][code] += 1
        if code in ("INTERNAL", "UNKNOWN"):
            tally.violations.append(f"{name}: {code} for {strategy} ({case.strategy}) from {case.caller}")
        if case.caller in BAD_CALLERS and code not in ("UNAUTHENTICATED", CLOSED):
            tally.violations.append(f"{name}: caller with {case.caller} answered {code} at HELLO, not UNAUTHENTICATED")

    def _frame(self, method_id: int, body: bytes) -> tuple[bytes, str, bool, int]:
        """(the bytes to send, what was done to them, whether the sender stops after them,
        the method id they name: an answer to another method is learned from as that one's)."""
        timeout_ms = int(CALL_TIMEOUT_S * 1000)
        roll = self.rng.random()
        if roll < 0.6:
            return frames.request_frame(method_id, timeout_ms, body), "as is", False, method_id
        if roll < 0.7:
            other = self.rng.randrange(0, 64)
            return frames.request_frame(other, timeout_ms, body), "method id", False, other
        if roll < 0.75:
            deadline = self.rng.choice((0, 1, 2**32 - 1))
            return frames.request_frame(method_id, deadline, body), "deadline", False, method_id
        header = frames.REQUEST_HEADER
        if roll < 0.85:
            cut = self.rng.randrange(0, len(body) + header.size)
            return frames.request_frame(method_id, timeout_ms, body)[:cut], "cut short", True, 0
        if roll < 0.9:
            claimed = len(body) + self.rng.choice((1, 100, frames.MAX_REQUEST_BYTES, 2**32 - 1 - len(body)))
            return header.pack(claimed, method_id, timeout_ms) + body, "length lies", True, 0
        return random_bytes(self.rng, self.rng.randint(1, 64)), "random bytes", True, 0

    def _connection(self, case: Case) -> tuple[socket.socket, str]:
        """A connection of the case's caller, and HELLO's answer ("OK" or the refusal)."""
        token = case.token if case.caller not in BAD_CALLERS else self._bad_token(case)
        if case.caller not in BAD_CALLERS and token in self._open:
            return self._open[token], "OK"
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        conn.settimeout(CALL_TIMEOUT_S)
        conn.sendall(frames.request_frame(frames.HELLO, 0, token.encode(errors="surrogateescape")))
        answer = _read_answer(conn)
        hello = CLOSED if answer is None else _CODES.get(answer[0], f"status {answer[0]}")
        if hello == "OK" and case.caller not in BAD_CALLERS:
            self._open[token] = conn
        else:
            conn.close()
        return conn, hello

    def _bad_token(self, case: Case) -> str:
        good = case.pools.token
        return self.rng.choice(("", "x" * 16, good[:-1], good + "x", "A" * 4000, f"Bearer {good}", "\udcff" + good))

    def _drop(self, case: Case) -> None:
        conn = self._open.pop(case.token or "", None)
        if conn is not None:
            conn.close()

    def _learn(self, case: Case, method: str, body: bytes, as_sent: bool) -> None:
        """Notes the leases and allocations handed out, so that the run gives them back
        (``as_sent``: the answer is to the case's own request, else to its bytes read as ``method``'s)."""
        service, name = method.split(".")
        output = _SERVICES[service].methods_by_name[name].output_type
        try:
            response = message_factory.GetMessageClass(output).FromString(body)
        except Exception:  # noqa: BLE001 - nothing to learn from an answer that does not parse
            return
        learn(case.pools, name, case.request if as_sent else None, response, case.token or "",
              case.page_keys if as_sent else [])


def _read_answer(conn: socket.socket) -> tuple[int, bytes] | None:
    """(status, body) of the next answer; None when the server closed the connection."""
    header = _exactly(conn, frames.ANSWER_HEADER.size)
    if header is None:
        return None
    body_bytes, status = frames.ANSWER_HEADER.unpack(header)
    body = _exactly(conn, body_bytes)
    return None if body is None else (status, body)


def _exactly(conn: socket.socket, num_bytes: int) -> bytes | None:
    data = b""
    while len(data) < num_bytes:
        try:
            chunk = conn.recv(num_bytes - len(data))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        data += chunk
    return data
