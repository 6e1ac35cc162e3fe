"""An emulated network link: a TCP proxy on 127.0.0.1 that paces bytes in each direction
to a set bandwidth (plus an optional one-way latency). Runs its own event loop in a thread
so that the benchmark's client is not slowed by it."""

from __future__ import annotations

import asyncio
import threading
import time

IDLE_GAP_S = 0.005  # behind the pace by more than this: the link was idle, not late


class LinkProxy:
    def __init__(self, upstream: str, bandwidth_bps: float, latency_s: float = 0.0) -> None:
        self.upstream_host, port = upstream.rsplit(":", 1)
        self.upstream_port = int(port)
        self.bandwidth_bps = bandwidth_bps
        self.latency_s = latency_s
        self.port = 0
        self.num_bytes = 0  # relayed, both directions (a test checks traffic took this path)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("link proxy did not start")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._server = server
        self._ready.set()
        self._loop.run_forever()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        start, sent = time.monotonic(), 0
        try:
            while True:
                data = await reader.read(64 << 10)
                if not data:
                    break
                sent += len(data)
                self.num_bytes += len(data)
                due = start + self.latency_s + sent / self.bandwidth_bps
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif delay < -IDLE_GAP_S:  # an idle gap: do not bank credit (a sleep's overshoot is no gap:
                    start, sent = time.monotonic() - self.latency_s, 0  # dropping it capped 0.4 GB/s at ~0.11)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        except asyncio.CancelledError:  # close(): ends quietly (3.11's stream server logs a cancelled handler as an error)
            return

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            # awaited, so that no connection's task is destroyed pending when the loop stops (logged as errors)
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
