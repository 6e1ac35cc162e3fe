"""A copy landed here unhashed that a reader found damaged: the node it came from is asked to
check its own copy, so that damage at the source is dropped there (DESIGN §4,
``placement/unchecked.py``). On the UCX and TCP planes: a one-page fetch with
``fetch_frames.VERIFY`` (the sender hashes it before sending and quarantines it if its bytes
fail). On the gRPC plane: a one-page ``ReadPages`` without ``unchecked``, whose send checks the
page the same way (services/data.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from kvstore._proto import data_pb2
from kvstore.page import PageHeader
from kvstore.page_wire.grpc_chunks import decode_chunk
from kvstore.server.cluster.peers import Peers
from kvstore.server.placement import Placement

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 10.0
MAX_CHECKS = 4  # in flight; past it a damaged copy is still dropped here, its source not asked (each takes a page of memory)


class SourceChecks:
    """``tenant_of``: a namespace's tenant here, named to the source on the gRPC plane (whose
    ReadPages answers a node only for a namespace bound to the tenant it names)."""

    def __init__(self, core: Placement, peers: Peers, tenant_of: Callable[[bytes], str | None] = lambda ns: None) -> None:
        self.core = core
        self._peers = peers
        self._tenant_of = tenant_of
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_asked = 0
        self.num_skipped = 0  # past MAX_CHECKS
        self._closed = False
        core.reads.unchecked.on_damaged(self._damaged)

    def _damaged(self, header: PageHeader, source: str) -> bool:
        """On the reader's thread: the check runs on the cluster loop; False once that or this closed."""
        if self._closed:  # a reader may call a listener it took just before the close (UncheckedCopies.damaged)
            return False
        try:
            self._loop.call_soon_threadsafe(self._start, header, source)
        except RuntimeError:
            return False
        return True

    def _start(self, header: PageHeader, source: str) -> None:
        if self._closed:  # nothing would cancel or await it
            return
        if len(self._tasks) >= MAX_CHECKS:
            self.num_skipped += 1
            logger.warning("page %s damaged here: %d source checks in flight already; %s not asked to check its copy",
                           header.key.hex(), MAX_CHECKS, source)
            return
        task = asyncio.ensure_future(self._check(header, source))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check(self, header: PageHeader, source: str) -> None:
        peer = self._peers.get(source) if self._peers is not None else None
        if peer is None:
            logger.info("page %s damaged here: its source %s is gone; not asked to check it", header.key.hex(), source)
            return
        self.num_asked += 1
        generation = self.core.directory.generation(header.namespace_id)
        if peer.fetcher is not None:  # the UCX or TCP plane
            outcome = await self._verify_fetch(peer, header, generation)
        else:
            outcome = await self._read_back(peer, header, generation)
        logger.warning("page %s landed from %s unhashed failed a reader's check here; %s checked its copy: %s",
                       header.key.hex(), source, source, outcome)

    @staticmethod
    async def _verify_fetch(peer: Any, header: PageHeader, generation: int) -> str:
        scratch = bytearray(header.payload_bytes)  # the bytes come back only when they are sound: dropped
        result = await peer.fetcher.fetch(header.namespace_id, [header.key], [scratch], CHECK_TIMEOUT_S, generation,
                                          verify=True, hashed=False)
        if result.error is None:
            return str(result.statuses[0].value)
        # asked to verify, a holder whose copy fails drops the connection before the page (transport_ucx.py, tcp_server.py)
        return f"not sent (its check failed there and it was quarantined, or the link failed: {result.error})"

    async def _read_back(self, peer: Any, header: PageHeader, generation: int) -> str:
        """The page read back over ReadPages, checked as its holder sends it: sent when sound,
        quarantined there and not sent when its bytes fail (or gone meanwhile)."""
        request = data_pb2.ReadPagesRequest(namespace_id=header.namespace_id, keys=[header.key], local_only=True,
                                            tenant=self._tenant_of(header.namespace_id) or "", generation=generation)
        try:
            call: Any = peer.pages.read_pages(request, timeout=CHECK_TIMEOUT_S)
        except grpc.aio.UsageError:  # its channel closed (it left)
            return "not asked: its channel is closed"
        sent = 0
        try:
            async for raw in call:
                sent += len(decode_chunk(raw).data)
        except grpc.aio.AioRpcError as exc:
            return f"failed: {exc.code().name}"
        finally:
            call.cancel()
        return "sound, sent" if sent else "not sent (its check failed there and it was dropped, or it is gone)"

    async def close(self) -> None:
        """Asks no more (the node leaves: a rejoin makes its own), cancels the checks in flight (its
        fetchers close next) and waits for them."""
        self._closed = True
        self.core.reads.unchecked.off_damaged(self._damaged)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
