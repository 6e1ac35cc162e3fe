"""kvstore-bench cluster-transport: GB/s of the UCX page fetch (kvstore.cluster.transport_ucx)
between two processes on loopback, beside a bare ucxx pump of the same message size and
``ucx_perftest`` tag_bw (C, shipped with the libucx wheel), per transport, in one run.

The fetcher asks for ``--batch`` pages per request into slots of a shared-memory arena and
verifies every checksum; the pump sends the same number of bytes as bare tagged messages
with nothing checked. Both run the same progress mode.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np

PAGE_BYTES = 2_359_296  # one 16-token Qwen3-8B BF16 page


def _serve(page_bytes: int, tls: str, mode: str, num_pages: int) -> None:
    """Child: a page server over ``num_pages`` distinct in-memory pages."""
    from kvstore.cluster.transport_ucx import SourcePage, UcxConfig, UcxPageServer
    from kvstore.page import checksum

    pages = [np.random.default_rng(i).integers(0, 256, page_bytes, dtype=np.uint8) for i in range(num_pages)]
    sums = [checksum(p) for p in pages]

    class Source:
        async def open_pages(self, namespace_id: bytes, keys: Sequence[bytes], generation: int = 0) -> list[SourcePage | None]:
            return [SourcePage(pages[int.from_bytes(k, "little") % num_pages], sums[int.from_bytes(k, "little") % num_pages])
                    for k in keys]

    async def main() -> None:
        server = UcxPageServer(Source(), UcxConfig(tls=tls, progress_mode=mode))
        print(await server.start(), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
        await server.close()

    asyncio.run(main())


def _pump_serve(page_bytes: int, tls: str, mode: str) -> None:
    """Child: a bare ucxx pump: on each request (a count), sends that many page-sized messages."""
    import ucxx

    ucxx.init(options={"TLS": tls, **({"MM_ERROR_HANDLING": "y"} if "sm" in tls else {})}, progress_mode=mode)
    src = np.random.default_rng(0).integers(0, 256, page_bytes, dtype=np.uint8)

    async def main() -> None:
        async def handler(ep: Any) -> None:
            count = np.empty(1, dtype=np.uint64)
            try:
                while True:
                    await ep.recv(count)
                    await asyncio.gather(*(ep.send(src) for _ in range(int(count[0]))))
            except ucxx.exceptions.UCXError:
                pass

        listener = ucxx.create_listener(handler)
        print(listener.port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        listener.close()

    asyncio.run(main())


def _child(*args: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.bench.cluster.cluster_transport", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _fetch_gbps(tls: str, mode: str, page_bytes: int, batch: int, total: int) -> float:
    """Child-side measurement (its own UCX, so each transport gets a fresh one)."""
    from kvstore.cluster.transport_ucx import FetchStatus, UcxConfig, UcxPageFetcher

    server, port = _child("--serve", str(page_bytes), tls, mode, str(batch))
    arena = shared_memory.SharedMemory(create=True, size=page_bytes * batch)
    buf = arena.buf
    assert buf is not None
    slots = [buf[i * page_bytes:(i + 1) * page_bytes] for i in range(batch)]
    np.frombuffer(buf, np.uint8)[:] = 0  # touch once, as a long-lived arena is

    async def main() -> float:
        fetcher = UcxPageFetcher("127.0.0.1", port, UcxConfig(tls=tls, progress_mode=mode))
        keys = [i.to_bytes(16, "little") for i in range(batch)]
        await fetcher.fetch(bytes(16), keys, slots, timeout_s=60)  # warm-up: connect, register
        t0, moved = time.perf_counter(), 0
        while moved < total:
            result = await fetcher.fetch(bytes(16), keys, slots, timeout_s=60)
            if result.statuses != [FetchStatus.OK] * batch:
                raise RuntimeError(f"fetch failed: {result.error}")
            moved += batch * page_bytes
        dt = time.perf_counter() - t0
        await fetcher.close()
        return moved / dt / 1e9

    try:
        return asyncio.run(main())
    finally:
        for s in slots:
            s.release()
        arena.close()
        arena.unlink()
        assert server.stdin is not None
        server.stdin.close()
        server.wait(20)


def _pump_gbps(tls: str, mode: str, page_bytes: int, batch: int, total: int) -> float:
    import ucxx

    ucxx.init(options={"TLS": tls, **({"MM_ERROR_HANDLING": "y"} if "sm" in tls else {})}, progress_mode=mode)
    server, port = _child("--pump-serve", str(page_bytes), tls, mode)
    dsts = [np.zeros(page_bytes, dtype=np.uint8) for _ in range(batch)]

    async def main() -> float:
        ep = await ucxx.create_endpoint("127.0.0.1", port)

        async def one_batch() -> None:
            await ep.send(np.array([batch], dtype=np.uint64))
            await asyncio.gather(*(ep.recv(d) for d in dsts))

        await one_batch()
        t0, moved = time.perf_counter(), 0
        while moved < total:
            await one_batch()
            moved += batch * page_bytes
        dt = time.perf_counter() - t0
        ep.abort()
        return moved / dt / 1e9

    try:
        return asyncio.run(main())
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(20)


def _pump_rounds(tls: str, mode: str, page_bytes: int, batch: int, total: int) -> None:
    """Child: the pump's client for paired rounds (``cluster_paired``): per line on stdin,
    moves ``total`` bytes from a pump server child and prints GB/s; stops at end of input."""
    import ucxx

    ucxx.init(options={"TLS": tls, **({"MM_ERROR_HANDLING": "y"} if "sm" in tls else {})}, progress_mode=mode)
    server, port = _child("--pump-serve", str(page_bytes), tls, mode)
    dsts = [np.zeros(page_bytes, dtype=np.uint8) for _ in range(batch)]

    async def main() -> None:
        ep = await ucxx.create_endpoint("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, sys.stdin.readline):
            t0, moved = time.perf_counter(), 0
            while moved < total:
                await ep.send(np.array([batch], dtype=np.uint64))
                await asyncio.gather(*(ep.recv(d) for d in dsts))
                moved += batch * page_bytes
            print(f"gbps {moved / (time.perf_counter() - t0) / 1e9}", flush=True)  # UCX may warn on stdout too
        ep.abort()

    try:
        asyncio.run(main())
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(20)


def _perftest_gbps(tls: str, page_bytes: int, iters: int) -> float | None:
    """ucx_perftest tag_bw from the libucx wheel; None when it is not there."""
    try:
        import libucx
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    exe = root / "bin" / "ucx_perftest"
    if not exe.exists():
        return None
    env = {**os.environ, "UCX_TLS": tls, "UCX_WARN_UNUSED_ENV_VARS": "n",
           "LD_LIBRARY_PATH": f"{root / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    port = str(20000 + os.getpid() % 10000)
    server = subprocess.Popen([str(exe), "-p", port], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            time.sleep(0.1)
            out = subprocess.run([str(exe), "127.0.0.1", "-p", port, "-t", "tag_bw", "-s", str(page_bytes), "-n", str(iters)],
                                 env=env, check=False, capture_output=True, text=True, timeout=120)
            m = re.search(r"Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+(\S+)\s+(\S+)", out.stdout)
            if m:
                return float(m.group(2)) * (1 << 20) / 1e9  # perftest's MB/s are MiB/s
        return None
    finally:
        server.kill()
        server.wait(60)  # as harness.KILL_WAIT_S (this module imports nothing of kvstore at its top)


def _measure(kind: str, tls: str, mode: str, page_bytes: int, batch: int, total: int) -> float:
    out = subprocess.run([sys.executable, "-m", "kvstore.bench.cluster.cluster_transport", "--measure", kind, tls, mode,
                          str(page_bytes), str(batch), str(total)], check=False, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} over {tls} failed: {out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transports", default="tcp,sm,self,tcp", help="';'-separated UCX_TLS values (default: tcp;sm,self,tcp)")
    p.add_argument("--progress", default="blocking", help="ucxx progress mode (blocking, polling, thread)")
    p.add_argument("--page-bytes", type=int, default=PAGE_BYTES)
    p.add_argument("--batch", type=int, default=32, help="pages per fetch request")
    p.add_argument("--gb", type=float, default=2.0, help="GB moved per measurement")


def run(args: argparse.Namespace) -> dict[str, Any]:
    transports = args.transports.split(";") if ";" in args.transports else ["tcp", "sm,self,tcp"]
    total = int(args.gb * 1e9)
    rows = []
    for tls in transports:
        fetch = _measure("fetch", tls, args.progress, args.page_bytes, args.batch, total)
        pump = _measure("pump", tls, args.progress, args.page_bytes, args.batch, total)
        perf = _perftest_gbps(tls, args.page_bytes, max(100, total // args.page_bytes))
        rows.append({"transport": tls, "progress": args.progress, "fetch_gbps": round(fetch, 3), "pump_gbps": round(pump, 3),
                     "perftest_gbps": round(perf, 3) if perf else None, "fetch_over_pump": round(fetch / pump, 2)})
    return {"page_bytes": args.page_bytes, "batch": args.batch, "rows": rows}


def print_table(report: dict[str, Any]) -> None:
    print(f"UCX page fetch, {report['page_bytes']}-byte pages, {report['batch']} per request, two processes on loopback")
    print(f"{'transport':>14} {'progress':>9} {'fetch GB/s':>10} {'ucxx pump':>10} {'perftest':>9} {'fetch/pump':>10}")
    for r in report["rows"]:
        perf = f"{r['perftest_gbps']:.2f}" if r["perftest_gbps"] else "n/a"
        print(f"{r['transport']:>14} {r['progress']:>9} {r['fetch_gbps']:>10.2f} {r['pump_gbps']:>10.2f} {perf:>9} "
              f"{r['fetch_over_pump']:>10.2f}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--serve":
        return _serve(int(argv[1]), argv[2], argv[3], int(argv[4]))
    if argv and argv[0] == "--pump-serve":
        return _pump_serve(int(argv[1]), argv[2], argv[3])
    if argv and argv[0] == "--pump-rounds":
        return _pump_rounds(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]))
    if argv and argv[0] == "--measure":
        kind, tls, mode, page, batch, total = argv[1:7]
        fn = _fetch_gbps if kind == "fetch" else _pump_gbps
        print(fn(tls, mode, int(page), int(batch), int(total)))
        return None
    from kvstore.bench.main import run_alone  # lazily, as this module's other imports: its children need none of it

    run_alone(sys.modules[__name__], argv)
    return None


if __name__ == "__main__":
    main()
