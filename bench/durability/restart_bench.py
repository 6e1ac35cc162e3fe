"""kvstore-bench restart: how long a user waits for a restarted server holding N pages.

More: bench/durability/README.md (### restart_bench.py).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import time
from pathlib import Path
from typing import Any

import grpc
from tqdm import tqdm

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.bench.common.harness import start_server
from kvstore.config import HostTierConfig, ServerConfig, SsdTierConfig
from kvstore.page import HEADER_BYTES, LayoutDesc, PageHeader, checksum
from kvstore.server.metrics import Metrics
from kvstore.server.placement import Placement
from kvstore.tiers.slab import round_up
from kvstore.tiers.ssd import SsdTier

NS = b"restart-bench-ns"
HOST_BYTES = 64 << 20
LOOKUP_PAGES = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=int, default=100_000, help="pages stored (each one really written: pages x (page bytes + 4 KiB) on disk)")
    p.add_argument("--page-bytes", type=int, default=4096)
    p.add_argument("--dir", default="bench-out/restart", help="work directory (on the filesystem to test)")


def _ssd_capacity(pages: int, page_bytes: int) -> int:
    return int(pages * (HEADER_BYTES + round_up(page_bytes)) * 1.05) + (64 << 20)


def _config(workdir: Path, pages: int, page_bytes: int) -> ServerConfig:
    """The configuration the server process gets from its flags (see ``_start``)."""
    ssd = SsdTierConfig(directory=workdir / "ssd", capacity_bytes=_ssd_capacity(pages, page_bytes), dwpd=0)
    return ServerConfig(listen="127.0.0.1:0", data_dir=workdir / "data", host=HostTierConfig(capacity_bytes=HOST_BYTES),
                        ssd=ssd, metrics_listen=None, node="restart-bench")


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def build(workdir: Path, pages: int, page_bytes: int, bar: Any) -> None:
    """Writes ``pages`` distinct pages as the server's durable writes do: slot writes, one
    fdatasync per batch, then the batch's index transaction."""
    config = _config(workdir, pages, page_bytes).ssd
    assert config is not None
    ssd = SsdTier(config)
    layout = LayoutDesc(1, 2, 1, page_bytes // 4, "float16", 1)
    payload = mmap.mmap(-1, round_up(page_bytes))  # aligned, as a host-arena slot is: O_DIRECT where allowed
    view = memoryview(payload)[:page_bytes]
    payload[:] = os.urandom(len(payload))
    try:
        for start in range(0, pages, 4096):
            entries = []
            for i in range(start, min(pages, start + 4096)):
                payload[:8] = i.to_bytes(8, "little")  # every page its own bytes and checksum
                offset = ssd.reserve(page_bytes)
                assert offset is not None, "the ssd capacity is sized for every page"
                header = PageHeader(NS, _key(i), layout, page_bytes, checksum(view))
                ssd.write([(offset, header, view)])
                entries.append((offset, header))
            ssd.commit(entries)
            bar.update(len(entries))
    finally:
        view.release()
        ssd.close()


def _cold(workdir: Path) -> str:
    """Empties the page cache, or else evicts the store's files from it; says which."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped (/proc/sys/vm/drop_caches)"
    except OSError as exc:
        reason = exc.strerror or str(exc)
    _evict_files(workdir)
    return f"NOT dropped ({reason} on /proc/sys/vm/drop_caches): only the store's files were evicted (fadvise)"


def _evict_files(workdir: Path) -> None:
    for path in workdir.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _cached_share(workdir: Path) -> float:
    """Share of the store's file pages in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    resident = total = 0
    for path in workdir.rglob("*"):
        size = path.stat().st_size if path.is_file() else 0
        if size == 0:
            continue
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
            n = -(-size // page)
            vec = (ctypes.c_ubyte * n)()
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))  # the export ends here; the mapping stays
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            resident += sum(b & 1 for b in vec)
            total += n
    return resident / total if total else 0.0


def _first_lookup(workdir: Path, pages: int, page_bytes: int) -> tuple[float, float, int]:
    """Starts kvstore-server on the store; returns (seconds until it printed ready, seconds
    until its first Lookup answered, pages its ssd tier recovered)."""
    keys = [_key(i) for i in range(min(pages, LOOKUP_PAGES))]
    start = time.perf_counter()
    server, addr = start_server(workdir, HOST_BYTES, _ssd_capacity(pages, page_bytes), "--ssd-dwpd", "0", "--node", "restart-bench")
    try:
        ready = time.perf_counter() - start
        with grpc.insecure_channel(addr) as ch:
            stub = directory_pb2_grpc.DirectoryStub(ch)
            found = stub.Lookup(directory_pb2.LookupRequest(namespace_id=NS, keys=keys)).num_pages
            answered = time.perf_counter() - start
            if found != len(keys):
                raise RuntimeError(f"the restarted server found {found} of the first {len(keys)} pages")
            stats = stub.Stats(directory_pb2.StatsRequest())
    finally:
        server.stop()
    return ready, answered, next(t.num_pages for t in stats.tiers if t.tier == "ssd")


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    try:
        start = time.perf_counter()
        with tqdm(total=args.pages, desc="writing", unit="page", disable=None) as bar:
            build(workdir, args.pages, args.page_bytes, bar)
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        core = Placement(_config(workdir, args.pages, args.page_bytes), Metrics())
        constructor_s = time.perf_counter() - start
        entries = len(core.directory)
        core.close()
        cache = _cold(workdir)
        cached = _cached_share(workdir)
        ready_s, lookup_s, recovered = _first_lookup(workdir, args.pages, args.page_bytes)
        data = (workdir / "ssd" / "pages.dat").stat()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"pages": args.pages, "page_bytes": args.page_bytes, "data_file_bytes": data.st_size,
            "data_file_allocated_bytes": data.st_blocks * 512, "build_s": round(build_s, 2),
            "recovered_pages": recovered, "directory_entries": entries, "page_cache": cache,
            "cached_share_at_start": round(cached, 4), "server_ready_s": round(ready_s, 3),
            "server_first_lookup_s": round(lookup_s, 3), "constructor_s": round(constructor_s, 3)}


def print_table(report: dict[str, Any]) -> None:
    print(f"{report['pages']:,} pages of {report['page_bytes']} B really written ({report['data_file_allocated_bytes'] / 2**20:,.0f} "
          f"MiB allocated in the data file, in {report['build_s']:.1f} s); restarted server recovered {report['recovered_pages']:,}")
    print(f"page cache before the start: {report['page_cache']}; {100 * report['cached_share_at_start']:.1f}% of the store's "
          "file pages cached")
    print(f"kvstore-server start -> first Lookup answered: {report['server_first_lookup_s']:.2f} s "
          f"(ready line after {report['server_ready_s']:.2f} s)")
    print(f"Placement core constructor alone, warm, in the building process: {report['constructor_s']:.2f} s "
          f"({report['directory_entries']:,} directory entries)")
