"""The failure contract every page fetcher keeps (kvstore/cluster/README.md), checked the same
way for each transport: its test file makes the sender and the fetcher, these check what the
fetch returned and what it left in the caller's buffers."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
from page_server_node import expected_page

from kvstore.cluster.page_fetch import FetchStatus

NS = bytes(16)
SENTINEL = 0xA5  # what a caller writes into the buffers a failed fetch gave back
DIES_AT, FREEZES_AT = 0xDD, 0xDC  # first byte of the first key: where the child sender dies / stops


def key(i: int, first: int = 1) -> bytes:
    return bytes([first]) + i.to_bytes(15, "little")


def untouched(slot: memoryview) -> bool:
    return bool((np.frombuffer(slot, np.uint8) == SENTINEL).all())


class Child:
    """A page server in a child process (page_server_node.py) and the port it serves on."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc, self.port = proc, port

    async def line(self) -> str:
        assert self.proc.stdout is not None
        return (await asyncio.wait_for(self.proc.stdout.readline(), 30)).decode().strip()

    async def line_starting(self, prefix: str) -> str:
        while not (line := await self.line()).startswith(prefix):
            pass
        return line


async def start_server(page_bytes: int, *node_args: str) -> Child:
    """page_server_node.py serving pages of ``page_bytes`` (``node_args``: its transport's)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, str(Path(__file__).parent / "page_server_node.py"),
                                                str(page_bytes), *node_args, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip()
    if not line.isdigit():
        proc.kill()
        raise RuntimeError(f"page server did not start: {line!r}")
    return Child(proc, int(line))


@asynccontextmanager
async def page_servers(*node_args: str) -> AsyncIterator[Callable[[int], Awaitable[Child]]]:
    """Starts page servers on demand; every one is resumed and killed at the end, whatever
    the test did to it (SIGSTOP included)."""
    started: list[Child] = []

    async def start(page_bytes: int) -> Child:
        started.append(await start_server(page_bytes, *node_args))
        return started[-1]

    try:
        yield start
    finally:
        for child in started:
            if child.proc.returncode is None:
                child.proc.send_signal(signal.SIGCONT)
                child.proc.kill()
            await child.proc.wait()


class Arena:
    """A shared-memory arena cut into page slots, as the host tier's (filled with a sentinel)."""

    def __init__(self, size: int) -> None:
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        np.frombuffer(self.shm.buf, np.uint8)[:] = SENTINEL
        self.views: list[memoryview] = []

    def slots(self, page_bytes: int, n: int) -> list[memoryview]:
        views = [self.shm.buf[i * page_bytes:(i + 1) * page_bytes] for i in range(n)]
        self.views += views
        return views

    def close(self) -> None:
        for v in self.views:
            v.release()
        self.shm.close()
        self.shm.unlink()


def keys_for(n: int, first: int) -> list[bytes]:
    return [key(0, first=first)] + [key(i) for i in range(1, n)]


async def check_killed_sender(fetcher: Any, child: Child, dests: list[memoryview], page: int) -> None:
    """The sender dies (SIGKILL) mid-answer: the fetch returns soon after with the verified
    pages that arrived and FAILED for the rest, never a hang."""
    keys = keys_for(len(dests), DIES_AT)
    t0 = time.monotonic()
    result = await fetcher.fetch(NS, keys, dests, timeout_s=60)
    assert time.monotonic() - t0 < 10, "the receiver noticed the dead sender late"
    assert await child.proc.wait() == -signal.SIGKILL
    assert result.prefix < len(keys) and result.error
    assert all(s is FetchStatus.OK for s in result.statuses[:result.prefix])
    assert all(s is FetchStatus.FAILED for s in result.statuses[result.prefix:])
    for i in range(result.prefix):
        assert np.array_equal(np.frombuffer(dests[i], np.uint8), expected_page(keys[i], page))
    await fetcher.close()


async def check_stopped_sender(fetcher: Any, child: Child, dests: list[memoryview], page: int, late_s: float,
                               settle_s: float = 0.0) -> None:
    """The sender freezes (SIGSTOP) mid-answer: the fetch returns at its 2 s deadline (within
    ``late_s`` more); resumed, the sender's bytes in flight must not reach the buffers the
    caller got back and reused (a fresh connection is served by it meanwhile; ``settle_s``:
    how long to give stray bytes to land before they are looked for)."""
    keys = keys_for(len(dests), FREEZES_AT)
    t0 = time.monotonic()
    result = await fetcher.fetch(NS, keys, dests, timeout_s=2)
    assert time.monotonic() - t0 < 2 + late_s
    failed = [i for i, s in enumerate(result.statuses) if s is FetchStatus.FAILED]
    assert failed and "Timeout" in (result.error or "")
    for i in failed:
        np.frombuffer(dests[i], np.uint8)[:] = SENTINEL  # the caller reuses the buffers it got back
    child.proc.send_signal(signal.SIGCONT)
    probe = await fetcher.fetch(NS, [key(7, first=2)], [bytearray(page)], timeout_s=20)  # a fresh connection
    assert probe.statuses == [FetchStatus.OK]
    await asyncio.sleep(settle_s)
    assert all(untouched(dests[i]) for i in failed)
    await fetcher.close()


async def _stopped(child: Child, timeout_s: float = 30.0) -> None:
    """Returns once the child process stopped itself (state T in /proc), its answer begun."""
    stat = Path(f"/proc/{child.proc.pid}/stat")
    end = time.monotonic() + timeout_s
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < end, "the page server never froze"
        await asyncio.sleep(0.01)


async def check_queued_fetch_keeps_its_deadline(fetcher: Any, child: Child, dests: list[memoryview], page: int,
                                                late_s: float) -> None:
    """A fetch queued behind another on the same connection (its sender frozen, SIGSTOP) returns
    at its own deadline, FAILED with a timeout, not at the end of the one ahead of it: a caller
    (a handoff's push, a reader's fill) is promised its timeout whatever else the peer serves."""
    ahead = asyncio.ensure_future(fetcher.fetch(NS, keys_for(len(dests), FREEZES_AT), dests, timeout_s=20))
    await _stopped(child)  # the frozen fetch holds the connection (a SIGCONT before the child's own SIGSTOP would be lost)
    t0 = time.monotonic()
    queued = await fetcher.fetch(NS, [key(5, first=3)], [bytearray(page)], timeout_s=0.5)
    assert time.monotonic() - t0 < 0.5 + late_s, "the queued fetch outlived its own deadline"
    assert queued.statuses == [FetchStatus.FAILED] and "Timeout" in (queued.error or "")
    child.proc.send_signal(signal.SIGCONT)
    await ahead
    probe = await fetcher.fetch(NS, [key(7, first=2)], [bytearray(page)], timeout_s=20)  # the fetcher still serves
    assert probe.statuses == [FetchStatus.OK]
    await fetcher.close()


async def check_fetch_from_an_offset(fetcher: Any, dests: list[memoryview], page: int) -> None:
    """A fetch from a byte offset (the rest of a handed-off page whose first layers came ahead,
    DESIGN §12.7): each page's bytes from there on land in a destination that long, unhashed, OK
    with the page's stored checksum (of the whole page); a missing page is reported, not sent; a
    hashed or verified fetch from an offset is refused (its checksum covers the whole page)."""
    from kvstore.errors import InvalidRequest
    from kvstore.page import checksum
    from kvstore.page_wire.fetch_frames import PENDING, VERIFY, FetchRequest

    offset = page // 4
    rests = [memoryview(d).cast("B")[offset:] for d in dests]
    keys = [key(0), key(1), key(2, first=0xFF)]
    result = await fetcher.fetch(NS, keys, rests[:3], timeout_s=20, hashed=False, offset=offset)
    assert result.statuses == [FetchStatus.OK, FetchStatus.OK, FetchStatus.MISSING]
    for i in (0, 1):
        whole = expected_page(keys[i], page)
        assert np.array_equal(np.frombuffer(rests[i], np.uint8), whole[offset:])
        assert result.checksums[i] == checksum(whole)
        assert (np.frombuffer(dests[i], np.uint8)[:offset] == SENTINEL).all()  # nothing before the offset written
    assert untouched(dests[2])
    again = await fetcher.fetch(NS, [key(3)], [dests[3]], timeout_s=20)  # whole pages on the same connection after
    assert again.statuses == [FetchStatus.OK]
    middle = await fetcher.fetch(NS, keys[:1], [rests[0][: page // 4]], timeout_s=20, hashed=False, offset=offset, page_bytes=page)
    assert middle.statuses == [FetchStatus.OK]  # a range inside the page: that long
    assert np.array_equal(np.frombuffer(rests[0][: page // 4], np.uint8), expected_page(keys[0], page)[offset : offset + page // 4])
    pending = await fetcher.fetch(NS, keys[:1], rests[:1], timeout_s=20, hashed=False, offset=offset, allocation=bytes([7]) * 16)
    assert pending.statuses == [FetchStatus.MISSING]  # a source without pending pages (or that allocation) sends none
    for hashed, verify in ((True, False), (False, True)):
        try:
            await fetcher.fetch(NS, keys[:1], rests[:1], timeout_s=20, hashed=hashed, verify=verify, offset=offset)
        except InvalidRequest:
            continue
        raise AssertionError("a hashed or verified fetch from an offset must be refused")
    for bad in (FetchRequest(1, NS, page, (keys[0],), VERIFY, 0, offset), FetchRequest(1, NS, page, (keys[0],), 0, 0, page),
                FetchRequest(1, NS, page, (keys[0],), 0, 0, offset, page), FetchRequest(1, NS, page, (keys[0],), PENDING),
                FetchRequest(1, NS, page, (keys[0],), 0, 0, 0, 0, bytes([7]) * 16)):
        try:
            FetchRequest.decode(bad.encode())
        except InvalidRequest:
            continue
        raise AssertionError(f"a sender must refuse {bad}")
