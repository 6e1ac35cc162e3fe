"""The SSD write budget counts the bytes that reach the device: header + padded payload of
every page and the index transactions, measured against the data file and the kernel's
I/O accounting, not against the budget's own counter."""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.kv import random_kv
from support.servers import ServerProcess, make_config

from kvstore import KVLayout, Namespace
from kvstore.bench.common.harness import KILL_WAIT_S
from kvstore.cli import ctl
from kvstore.client import KVStoreClient
from kvstore.errors import TierFull

MLA = KVLayout(num_layers=3, num_kv_heads=1, head_dim=576, dtype=torch.bfloat16, page_tokens=16, attention="mla")
NS = Namespace(model="budget", revision="r", layout=MLA)


def _file_bytes(path: Path) -> int:
    """The data file's length: slots are taken in order from offset 0 of a fresh file and
    each is written once, whole, so its growth is the bytes written to it."""
    return path.stat().st_size if path.exists() else 0


def _device_write_bytes(pid: int) -> int:
    """Bytes process ``pid`` caused to be sent to storage (the kernel's count)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no write_bytes in /proc/<pid>/io")


def _written_bytes(address: str, capsys: pytest.CaptureFixture[str]) -> float:
    assert ctl.main(["--server", address, "--json", "stats"]) == 0
    return float(json.loads(capsys.readouterr().out)["ssd"]["written_bytes"])


@pytest.fixture
def shm_data_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server whose directory and token log live on tmpfs (which the kernel does not count
    as device writes), so that what it writes to storage is the ssd tier's writes only."""
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="kvstore-test-") as data:
        proc = ServerProcess(tmp_path, "--data-dir", data)
        yield proc
        if proc.proc is not None and proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait(KILL_WAIT_S)


async def test_written_bytes_are_the_bytes_the_device_receives(shm_data_server, capsys) -> None:
    """Bug: the budget counted payload bytes (55,296 per MLA page) while each write is a
    4 KiB header + the payload padded to 57,344, plus index pages; kvstore-ctl stats said
    2.21 MB where the device got over 2.46 MB."""
    shm_data_server.start()
    pid = shm_data_server.proc.pid
    data_file = shm_data_server.tmp / "ssd" / "pages.dat"
    tokens = list(range(40 * 16))
    before = (_written_bytes(shm_data_server.address, capsys), _device_write_bytes(pid), _file_bytes(data_file))
    async with KVStoreClient(shm_data_server.address, NS) as client:
        assert await client.put(tokens, random_kv(MLA, len(tokens), seed=3), durable=True) == len(tokens)
    counted = _written_bytes(shm_data_server.address, capsys) - before[0]
    device = _device_write_bytes(pid) - before[1]
    data = _file_bytes(data_file) - before[2]
    assert data == 40 * (4096 + 57_344)
    assert device > data, "the index transactions reach the device too"
    assert counted == pytest.approx(device, rel=0.01), (counted, device, data)
    assert shm_data_server.terminate() == 0


async def test_durable_writes_never_exceed_the_burst_on_disk(server_factory, tmp_path) -> None:
    """Bug: a bucket of 16 MiB let 303 MLA pages through (payload bytes) while the data file
    grew by 303 × 60 KiB = 18.6 MB. The file's growth, plus what refilled meanwhile, stays
    within the burst."""
    config = make_config(tmp_path)
    config = dataclasses.replace(config, ssd=dataclasses.replace(config.ssd, dwpd=1.0))
    server = server_factory(config)
    budget = server.core.lower[0].budget
    assert budget.burst_bytes == 16 << 20
    data_file = tmp_path / "ssd" / "pages.dat"
    before = _file_bytes(data_file)
    started = time.monotonic()
    tokens = list(range(400 * 16))
    async with KVStoreClient(server.address, NS) as client:
        with pytest.raises(TierFull, match="write budget"):
            await client.put(tokens, random_kv(MLA, len(tokens), seed=4), durable=True)
        hit = await client.lookup(tokens)
    refilled = (time.monotonic() - started) * budget.rate_bps
    grown = _file_bytes(data_file) - before
    assert 0 < grown <= budget.burst_bytes + refilled, (grown, budget.burst_bytes)
    assert hit.num_tokens > 0 and server.core.stats().ssd["written_bytes"] >= grown


def test_bytes_known_after_the_write_are_charged_into_debt() -> None:
    """Index bytes are measured after their transaction: they are counted as written and
    taken from the bucket even below zero, and no page write is admitted until the debt
    is repaid by the refill."""
    from kvstore.server.admission import WriteBudget

    now = [0.0]
    measured = [0]

    def settle() -> int:
        spent, measured[0] = measured[0], 0
        return spent

    budget = WriteBudget(1000.0, 10_000, lambda: now[0], settle=settle)
    assert budget.take(8_000)
    measured[0] = 5_000  # an index transaction after the write
    assert not budget.can_take(1), "3,000 bytes of debt"
    assert budget.written_bytes == 13_000
    now[0] = 3.0  # 3,000 bytes refilled: the debt is paid, nothing more
    assert not budget.can_take(1)
    now[0] = 4.0
    assert budget.take(1_000) and not budget.can_take(1)
    unlimited = WriteBudget(0, 0, lambda: now[0], settle=settle)
    measured[0] = 7
    assert unlimited.take(10**12) and unlimited.written_bytes == 10**12 + 7, "no budget: still counted"
