"""kvstore-pd-proxy: an OpenAI-compatible front for disaggregated prefill with kvstore.

More: kvstore/cli/README.md (### pd_proxy.py).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from kvstore.cli import pd_fields
from kvstore.cli import pd_first_token as first_token

logger = logging.getLogger(__name__)

PATHS = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("authorization", "x-request-id")
JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean", type(None): "null"}


@dataclass(frozen=True)
class Backend:
    """A ``vllm serve`` instance; ``node``: the kvstore node beside it (decode instances)."""

    url: str
    node: str = ""

    def connect(self, timeout_s: float) -> http.client.HTTPConnection:
        parts = urlsplit(self.url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        return cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)


@dataclass
class ProxyConfig:
    prefills: list[Backend]
    decodes: list[Backend]
    timeout_s: float = 600.0
    deadline_s: float | None = None  # the decode's wait for a handoff (kvstore_deadline_s); None: the connector's
    _turns: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.prefills or not self.decodes:
            raise ValueError("give at least one --prefill and one --decode")
        self._turns = (itertools.cycle(self.prefills), itertools.cycle(self.decodes))

    def pick(self) -> tuple[Backend, Backend]:
        with self._lock:
            return next(self._turns[0]), next(self._turns[1])


def prefill_body(body: dict[str, Any], decode: Backend) -> dict[str, Any]:
    """The prefill's request: one token, not streamed, asking for a remote decode at ``decode``'s node."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")} | pd_fields.one_token(body)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                 "kvstore_decode_node": decode.node or None}
    return out


def _params(answer: dict[str, Any] | None) -> dict[str, Any] | None:
    """The handoff's kv_transfer_params in a prefill's answer, if any."""
    params = (answer or {}).get("kv_transfer_params")
    return params if isinstance(params, dict) else None


def decode_body(body: dict[str, Any], params: dict[str, Any] | None, deadline_s: float | None) -> dict[str, Any]:
    """The original request, with the prefill's handoff (none: the decode computes the prompt)."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if params:
        out["kv_transfer_params"] = dict(params, **({"kvstore_deadline_s": deadline_s} if deadline_s else {}))
    return out


class ProxyHandler(BaseHTTPRequestHandler):
    server: ProxyServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s " + format, self.address_string(), *args)

    def _headers(self) -> dict[str, str]:
        return {k: v for k, v in self.headers.items() if k.lower() in FORWARDED_HEADERS}

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, b'{"status": "ok"}')
            return
        _, decode = self.server.config.pick()  # /v1/models and the like: the decode instance answers
        self._relay(decode, "GET", self.path, None)

    def do_POST(self) -> None:
        if self.path not in PATHS:
            self._reply(404, json.dumps({"error": f"not proxied: {self.path}; use {' or '.join(PATHS)}"}).encode())
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        except (ValueError, RecursionError) as exc:
            self._refuse(f"the body is not JSON: {exc}")
            return
        if not isinstance(body, dict):
            self._refuse(f"the body must be a JSON object, not {JSON_TYPES.get(type(body), type(body).__name__)}")
            return
        prefill, decode = self.server.config.pick()
        if not pd_fields.splittable(body, chat=self.path != "/v1/completions"):
            # a value vLLM refuses: its answer, and no handoff that no decode would read (DESIGN §12.7)
            self._relay(decode, "POST", self.path, decode_body(body, None, None))
            return
        if self.path == "/v1/completions" and first_token.eligible(body):
            self._first_token(prefill, decode, body)
            return
        params = _params(self._prefill(prefill, self.path, prefill_body(body, decode)))
        self._relay(decode, "POST", self.path, decode_body(body, params, self.server.config.deadline_s))

    def _first_token(self, prefill: Backend, decode: Backend, body: dict[str, Any]) -> None:
        """A completion whose first token is the prefill's (pd_first_token.py): shown at once,
        the decode continuing from the prompt and it; else (no usable token) today's way."""
        single = body.get("max_tokens", pd_fields.COMPLETIONS_MAX_TOKENS) == 1  # the prefill's answer is the whole one
        transfer = None if single else prefill_body(body, decode)["kv_transfer_params"]
        answer = self._prefill(prefill, self.path, first_token.prefill_body(body, transfer))
        first = first_token.first_token(answer) if answer is not None else None
        if answer is None or first is None:
            self._relay(decode, "POST", self.path, decode_body(body, _params(answer), self.server.config.deadline_s))
            return
        prompt, token, text, finish = first
        if first_token.ends_at_first(body, finish):
            self._answer_alone(body, answer, prompt, token, text, finish)
            return
        params = _params(answer)
        if not text:  # a partial character or a skipped token: the decode samples it again from the prompt
            self._relay(decode, "POST", self.path, decode_body(body, params, self.server.config.deadline_s))
            return
        later = first_token.decode_body(body, prompt, token, decode_body({}, params, self.server.config.deadline_s).get(
            "kv_transfer_params"))
        if not body.get("stream"):
            self._merged(decode, body, later, prompt, token, text)
            return
        self._start_stream()
        self._chunk(first_token.first_event(body, answer, prompt, token, text, None))
        self._relay_stream(decode, later, answer.get("id"))

    def _answer_alone(self, body: dict[str, Any], answer: dict[str, Any], prompt: list[int], token: int, text: str,
                      finish: str | None) -> None:
        if not body.get("stream"):
            self._reply(200, json.dumps(first_token.answer(body, answer)).encode())
            return
        self._start_stream()
        self._chunk(first_token.first_event(body, answer, prompt, token, text, finish))
        if (body.get("stream_options") or {}).get("include_usage"):
            self._chunk(first_token.usage_event(answer))
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _merged(self, decode: Backend, body: dict[str, Any], later: dict[str, Any], prompt: list[int], token: int,
                text: str) -> None:
        """A request not streamed: the decode's answer with the first token in front."""
        conn = decode.connect(self.server.config.timeout_s)
        try:
            conn.request("POST", self.path, json.dumps(later).encode(), {"content-type": "application/json", **self._headers()})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status == 200:
                data = json.dumps(first_token.merged(body, prompt, token, text, json.loads(data))).encode()
            self._reply(resp.status, data)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            logger.warning("%s %s failed: %s", decode.url, self.path, exc)
            self._reply(502, json.dumps({"error": f"{decode.url}: {exc}"}).encode())
        finally:
            conn.close()

    def _relay_stream(self, decode: Backend, later: dict[str, Any], stream_id: str | None) -> None:
        """The decode's stream after the first event, line by line (pd_first_token.relayed_line)."""
        conn = decode.connect(self.server.config.timeout_s)
        try:
            conn.request("POST", self.path, json.dumps(later).encode(), {"content-type": "application/json", **self._headers()})
            resp = conn.getresponse()
            if resp.status != 200:  # the client has its 200 and first token: the error goes as an event
                self._chunk(b"data: %s\n\ndata: [DONE]\n\n" % json.dumps({"error": resp.read().decode(errors="replace")}).encode())
            else:
                while line := resp.readline():
                    self._chunk(first_token.relayed_line(line, stream_id))
            self.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException) as exc:
            logger.warning("%s %s failed: %s", decode.url, self.path, exc)
            self.close_connection = True  # the client sees the answer cut short
        finally:
            conn.close()

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _prefill(self, prefill: Backend, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The prefill's answer; None when it failed (the decode then computes the prompt)."""
        conn = prefill.connect(self.server.config.timeout_s)
        try:
            conn.request("POST", path, json.dumps(body).encode(), {"content-type": "application/json", **self._headers()})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                logger.warning("prefill %s answered %d: %s; the decode computes the prompt", prefill.url, resp.status,
                               data[:300])
                return None
            answer = json.loads(data)
            return answer if isinstance(answer, dict) else None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            logger.warning("prefill %s failed: %s; the decode computes the prompt", prefill.url, exc)
            return None
        finally:
            conn.close()

    def _relay(self, backend: Backend, method: str, path: str, body: dict[str, Any] | None) -> None:
        """Sends the request to ``backend`` and copies its answer back as it comes (chunked)."""
        conn, started = backend.connect(self.server.config.timeout_s), False
        try:
            payload = None if body is None else json.dumps(body).encode()
            conn.request(method, path, payload, {"content-type": "application/json", **self._headers()})
            resp = conn.getresponse()
            self.send_response(resp.status)
            self.send_header("content-type", resp.getheader("content-type", "application/json"))
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            started = True
            while chunk := resp.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException) as exc:
            logger.warning("%s %s failed: %s", backend.url, path, exc)
            self.close_connection = True
            if not started:  # else the client sees the answer cut short
                try:
                    self._reply(502, json.dumps({"error": f"{backend.url}: {exc}"}).encode())
                except OSError:
                    pass
        finally:
            conn.close()

    def _refuse(self, message: str) -> None:
        """A 400 for the client's request in vLLM's error shape (its request validation's)."""
        error = {"message": message, "type": "Bad Request", "param": None, "code": 400}
        self._reply(400, json.dumps({"error": error}).encode())

    def _reply(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], config: ProxyConfig) -> None:
        super().__init__(address, ProxyHandler)
        self.config = config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore-pd-proxy", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="OpenAI-compatible proxy for disaggregated prefill over kvstore: prefill on one "
                                            "vllm serve, decode on another, the KV handed off through kvstore.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one, printed at start)")
    p.add_argument("--prefill", action="append", metavar="URL", help="a prefill vllm serve (repeat for several; taken in turn)")
    p.add_argument("--decode", action="append", metavar="URL", help="a decode vllm serve (repeat for several; taken in turn)")
    p.add_argument("--decode-node", action="append", metavar="NODE_ID", default=None,
                   help="the kvstore node id beside each --decode, in the same order (its kvstore-server's --node-id): "
                        "the prefill's node pushes the pages there; none: the decode finds them through the pool")
    p.add_argument("--handoff-deadline-s", type=float, default=None,
                   help="how long a decode waits for a handoff before it recomputes; %(default)s: the decode connector's "
                        "handoff_deadline_s")
    p.add_argument("--timeout-s", type=float, default=600.0, help="the most one request to an instance may take")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="least severity logged (stderr)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    nodes = args.decode_node or []
    if not args.prefill or not args.decode:
        print("kvstore-pd-proxy: give at least one --prefill URL and one --decode URL", file=sys.stderr)
        return 2
    if nodes and len(nodes) != len(args.decode):
        print("kvstore-pd-proxy: give one --decode-node per --decode, or none", file=sys.stderr)
        return 2
    config = ProxyConfig([Backend(url) for url in args.prefill],
                         [Backend(url, nodes[i] if nodes else "") for i, url in enumerate(args.decode)],
                         args.timeout_s, args.handoff_deadline_s)
    server = ProxyServer((args.host, args.port), config)
    print(f"kvstore-pd-proxy listening on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
