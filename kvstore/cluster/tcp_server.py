"""The sending side of the TCP data plane: a listener thread and one thread per connection,
serving pages from a ``PageSource`` (whose ``open_pages`` runs on the event loop that
started the server, as the UCX page server's does; a ``BlockingPageSource``, the node's own,
is opened on the connection's thread instead).

More: kvstore/cluster/README.md (### tcp_server.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from kvstore.cluster.cluster_errors import TransportError
from kvstore.cluster.page_fetch import BlockingPageSource, PageSource, SourcePage, answer_for, open_pending
from kvstore.cluster.tcp_socket import Deadline, recv_frame, send_exact, send_frame, send_hashed, shut, tune, wait_frame
from kvstore.errors import ConfigError, InvalidRequest
from kvstore.logs import Throttled
from kvstore.page_wire.fetch_frames import (
    DESCRIBE,
    HELLO_BYTES,
    MAX_FRAME_BYTES,
    PENDING,
    VERIFY,
    FetchRequest,
    PageStatus,
    decode_hello,
)
from kvstore.pagecopy import running_checksum

logger = logging.getLogger(__name__)
_refusals = Throttled(logger)  # a scanner at the data port must not flood the log

HELLO_TIMEOUT_S = 5.0  # a connection that presents no grant within it is dropped
MAX_ADMITTING = 64  # connections still presenting their grant at once; a newer one closes the oldest
MAX_CONNECTIONS_PER_NODE = 8  # a node's fetcher keeps one per peer; a newer one supersedes its oldest
MAX_CONNECTIONS = 256  # admitted in all: a caller names the node id its grant is for, so ids are no bound
DAMAGED = "its bytes in the arena do not match its checksum (checked before sending over TCP)"


def send_verified(sock: socket.socket, page: SourcePage, deadline: Deadline) -> bool:
    """Sends a page straight from its memory, chunk by chunk, each hashed just before it is
    sent (so the kernel copies it from cache); the last chunk only if the whole page matched
    its stored checksum. False (the rest unsent: drop the connection) when it did not."""
    return send_hashed(sock, memoryview(page.data).cast("B"), running_checksum(), page.checksum, deadline)


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # another name may resolve anywhere
        return False


def start_thread(target: Callable[..., None], *args: Any, name: str) -> bool:
    """Starts a daemon thread; False when the process cannot start one (out of threads)."""
    try:
        threading.Thread(target=target, args=args, name=name, daemon=True).start()
    except RuntimeError:
        return False
    return True


class TcpPageServer:
    def __init__(self, source: PageSource, host: str = "127.0.0.1", port: int = 0, send_timeout_s: float = 30.0,
                 authorize: Callable[[bytes], str | None] | None = None) -> None:
        self._source = source
        self._host, self._port = host, port
        self._send_timeout_s = send_timeout_s  # a fetcher that stops reading must not pin pages forever
        self._authorize = authorize
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._by_node: dict[str, list[socket.socket]] = {}  # admitted connections per node, oldest first
        self._presenting: dict[socket.socket, None] = {}  # accepted, no grant presented yet, oldest first
        self._listener: socket.socket | None = None
        self._closing = False  # set under the lock: a connection accepted after it is closed, not served
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = threading.Condition(self._lock)

    @property
    def port(self) -> int:
        assert self._listener is not None
        return int(self._listener.getsockname()[1])

    async def start(self) -> int:
        if self._authorize is None and not _loopback(self._host):
            raise ConfigError(f"a TCP page server without grants (authorize) serves anyone: it listens on loopback only, "
                              f"not {self._host!r}")
        self._loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune(listener)  # accepted sockets start with its buffers and congestion control
            listener.bind((self._host, self._port))
            listener.listen(128)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._closing = False
        if not start_thread(self._accept, listener, name="tcp-pages-accept"):
            listener.close()
            raise TransportError("cannot start the TCP page server's accept thread")
        return self.port

    async def close(self) -> None:
        """Stops accepting, ends every connection, and waits (bounded) until their threads
        have released every page they held."""
        with self._lock:  # the accept thread counts a connection under it, so none escapes this look
            self._closing = True
            conns = list(self._conns)
        listener, self._listener = self._listener, None
        if listener is not None:
            shut(listener)  # wakes the accept thread
            listener.close()
        for conn in conns:
            shut(conn)
        await asyncio.to_thread(self._wait_idle, 5.0)

    def _wait_idle(self, timeout_s: float) -> None:
        with self._idle:
            self._idle.wait_for(lambda: not self._conns, timeout_s)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closing:  # accepted as close() looked at the connections: it would outlive close()
                    conn.close()
                    return
                if self._authorize is not None:
                    if len(self._presenting) >= MAX_ADMITTING:  # its thread sees the connection end and drops it
                        oldest = next(iter(self._presenting))
                        del self._presenting[oldest]
                        shut(oldest)
                        _refusals.warning("busy", "TCP connections to the data port: %d were presenting their grant; "
                                          "closed the oldest", MAX_ADMITTING)
                    self._presenting[conn] = None
                self._conns.add(conn)
            if not start_thread(self._connection, conn, name="tcp-pages"):
                logger.warning("refused a TCP connection to the data port: cannot start a thread for it")
                self._gone(conn)

    def _gone(self, conn: socket.socket) -> None:
        shut(conn)
        conn.close()
        with self._idle:
            self._presenting.pop(conn, None)
            self._conns.discard(conn)
            for node, conns in list(self._by_node.items()):
                if conn in conns:
                    conns.remove(conn)
                    if not conns:
                        del self._by_node[node]
            self._idle.notify_all()

    def _connection(self, conn: socket.socket) -> None:
        try:
            tune(conn)
            node = self._admit(conn) if self._authorize is not None else ""
            if node is None:
                return
            with self._lock:
                held = True
                if self._authorize is not None:
                    self._presenting.pop(conn, None)
                    held = self._hold(node, conn)
            if not held:
                _refusals.warning("full", "refused a TCP connection to the data port: %d connections are admitted",
                                  MAX_CONNECTIONS)
                return
            while (body := wait_frame(conn, MAX_FRAME_BYTES)) is not None:
                if not self._serve(conn, FetchRequest.decode(body)):
                    return
        except (OSError, TimeoutError, TransportError) as exc:
            logger.debug("page fetcher went away: %r", exc)
        except InvalidRequest as exc:
            logger.warning("dropping a TCP page fetch connection that sent a bad frame: %s", exc)
        except Exception:
            logger.exception("TCP page server connection failed")
        finally:
            self._gone(conn)

    def _hold(self, node: str, conn: socket.socket) -> bool:
        """Counts an admitted connection to its node (lock held); past the cap the node's
        oldest is shut (its thread ends it): one node's grants must not buy unbounded threads
        and fds, and a peer host that vanished leaves idle connections nothing else ends.
        False (not counted: drop it) when MAX_CONNECTIONS are admitted already."""
        conns = self._by_node.setdefault(node, [])
        if len(conns) < MAX_CONNECTIONS_PER_NODE and sum(map(len, self._by_node.values())) >= MAX_CONNECTIONS:
            if not conns:
                del self._by_node[node]
            return False
        conns.append(conn)
        while len(conns) > MAX_CONNECTIONS_PER_NODE:
            shut(conns.pop(0))
            _refusals.warning("superseded", "node %s opened more than %d TCP data connections: closed its oldest",
                              node, MAX_CONNECTIONS_PER_NODE)
        return True

    def _admit(self, conn: socket.socket) -> str | None:
        """The node whose live grant the connection's hello presents, None when it presents
        none (bounded in size and time: an unauthenticated peer gets neither a large buffer
        nor a thread that waits forever)."""
        assert self._authorize is not None
        try:
            grant = decode_hello(recv_frame(conn, HELLO_BYTES, Deadline(HELLO_TIMEOUT_S)))
        except InvalidRequest as exc:
            kind, reason = "no-grant", f"no grant ({exc})"
        except TimeoutError:
            kind, reason = "silent", f"no grant within {HELLO_TIMEOUT_S:.0f} s"
        except (OSError, TransportError) as exc:
            kind, reason = "no-grant", f"no grant (closed: {exc})"
        else:
            node = self._authorize(grant)
            if node is not None:
                logger.debug("TCP connection of node %s admitted", node)
                return node
            kind, reason = "bad-grant", "its grant is unknown, used or expired"
        with self._lock:
            _refusals.warning(kind, "refused a TCP connection to the data port: %s", reason)
        return None

    def _open(self, request: FetchRequest) -> list[SourcePage | None]:
        """The source's pages: opened on this connection's thread when the source can be
        (``BlockingPageSource``: no hop to the loop and back), else on the server's event
        loop; on a timeout every page it opens later is released at once."""
        if request.flags & PENDING:
            return open_pending(self._source, request)
        if isinstance(self._source, BlockingPageSource):
            return self._source.open_pages_now(request.namespace_id, request.keys, request.generation)
        assert self._loop is not None
        opened = self._source.open_pages(request.namespace_id, request.keys, request.generation)
        future = asyncio.run_coroutine_threadsafe(opened, self._loop)
        try:
            return future.result(self._send_timeout_s)
        except TimeoutError:
            future.add_done_callback(lambda f: [p.release() for p in (f.result() if not f.cancelled() and f.exception() is None
                                                                        else []) if p is not None])
            raise

    def _serve(self, conn: socket.socket, request: FetchRequest) -> bool:
        """Answers one request; False when the connection must be dropped (asked to VERIFY, a
        page failed its check). Unasked, pages go out as they are: the receiver checks each."""
        pages = self._open(request)
        try:
            answer = answer_for(request, pages)
            deadline = Deadline(self._send_timeout_s)
            send_frame(conn, answer.encode(), deadline)
            if request.flags & DESCRIBE:
                return True
            verify = bool(request.flags & VERIFY)  # else the receiver's check is the page's one (fetch_frames.py)
            for key, page, entry in zip(request.keys, pages, answer.entries):
                if page is None or entry.status is not PageStatus.FOUND:
                    continue
                if not verify:
                    send_exact(conn, memoryview(page.data).cast("B")[request.offset : request.offset + request.sent_bytes], deadline)
                elif not send_verified(conn, page, deadline):
                    logger.warning("page %s not sent to a peer: %s", key.hex(), DAMAGED)
                    page.damaged(DAMAGED)
                    return False
            return True
        finally:
            for page in pages:  # every send has returned: the kernel holds its own copy of the bytes
                if page is not None:
                    page.release()

    def connections(self) -> int:
        """Connections open now (for tests: silent ones must not pile up)."""
        with self._lock:
            return len(self._conns)

