"""kvstore-bench restart: how long a server takes to recover N stored pages (the SSD index
cross-checked against the data file, the directory rebuilt and reconciled with it).

The state is made through the tiers' own index and directory code with small payloads in a
sparse data file: recovery reads metadata only, so its time depends on the page count, not
on the bytes."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvstore.config import HostTierConfig, ServerConfig, SsdTierConfig
from kvstore.metrics import Metrics
from kvstore.page import HEADER_BYTES, LayoutDesc, PageHeader
from kvstore.tier_manager import TierManager
from kvstore.tiers.slab import round_up


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=int, default=1_000_000)
    p.add_argument("--page-bytes", type=int, default=4096)
    p.add_argument("--dir", default="bench-out/restart")


def _config(workdir: Path, pages: int, page_bytes: int) -> ServerConfig:
    slot = HEADER_BYTES + round_up(page_bytes)
    ssd = SsdTierConfig(directory=workdir / "ssd", capacity_bytes=int(pages * slot * 1.05) + (64 << 20), dwpd=0, direct_io=False)
    return ServerConfig(listen="127.0.0.1:0", data_dir=workdir / "data", host=HostTierConfig(capacity_bytes=64 << 20),
                        ssd=ssd, metrics_listen=None, node="restart-bench")


def build(workdir: Path, pages: int, page_bytes: int, bar: Any) -> None:
    config = _config(workdir, pages, page_bytes)
    manager = TierManager(config, Metrics())
    ssd = manager.ssd
    assert ssd is not None
    layout = LayoutDesc(1, 2, 1, page_bytes // 4, "float16", 1)
    ns = b"restart-bench-ns"
    batch = 20_000
    top = 0
    for start in range(0, pages, batch):
        entries = []
        for i in range(start, min(pages, start + batch)):
            offset = ssd.reserve(page_bytes)
            assert offset is not None
            top = max(top, offset + HEADER_BYTES + round_up(page_bytes))
            entries.append((offset, PageHeader(ns, i.to_bytes(16, "little"), layout, page_bytes, i)))
        ssd.index(entries)
        manager.directory.publish(ns, [(h.key, manager.node, "ssd", page_bytes) for _, h in entries])
        bar.update(len(entries))
    os.ftruncate(ssd.fd, top)  # sparse: recovery checks offsets against the file size
    manager.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    with tqdm(total=args.pages, desc="building", unit="page", disable=None) as bar:
        build(workdir, args.pages, args.page_bytes, bar)
    try:
        start = time.perf_counter()
        manager = TierManager(_config(workdir, args.pages, args.page_bytes), Metrics())
        seconds = time.perf_counter() - start
        recovered = manager.ssd.usage().num_pages if manager.ssd else 0
        entries = len(manager.directory)
        manager.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"pages": args.pages, "recovered_pages": recovered, "directory_entries": entries, "seconds": round(seconds, 3),
            "pages_per_s": round(args.pages / seconds)}


def print_table(report: dict[str, Any]) -> None:
    print(f"recovered {report['recovered_pages']} pages ({report['directory_entries']} directory entries) "
          f"in {report['seconds']:.2f} s ({report['pages_per_s']:,} pages/s)")
