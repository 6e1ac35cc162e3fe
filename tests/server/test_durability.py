"""Restart and damage: SIGKILL keeps ssd pages, RAM pages are cleanly gone, a flipped byte
on disk is never served and is quarantined."""

from __future__ import annotations

import os

import grpc
import pytest
import torch
from support.kv import random_kv
from support.servers import flip_arena_byte

from kvstore._proto import data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.client import Hit, KVStoreClient
from kvstore.errors import PageCorrupt
from kvstore.page import HEADER_BYTES, LayoutDesc
from kvstore.tiers.base import ReadResult
from kvstore.validate import layout_msg


async def test_sigkill_restart_keeps_ssd_pages(server_process, layout, ns) -> None:
    server_process.start()
    durable_tokens = list(range(320))
    ram_tokens = list(range(5000, 5320))
    kv = random_kv(layout, 320, seed=4)
    async with KVStoreClient(server_process.address, ns) as client:
        assert await client.put(durable_tokens, kv, durable=True) == 320
        assert await client.put(ram_tokens, kv) == 320
        hit = await client.lookup(durable_tokens)
        assert {loc.tier for loc in hit.locations} == {"host"}
    server_process.kill()
    server_process.start()
    async with KVStoreClient(server_process.address, ns) as client:
        hit = await client.lookup(durable_tokens)
        assert hit.num_tokens == 320
        assert {loc.tier for loc in hit.locations} == {"ssd"}
        out = torch.empty_like(kv)
        await client.get(hit, into=out)
        assert torch.equal(out, kv)
        assert (await client.lookup(ram_tokens)).num_tokens == 0, "RAM-only pages must be cleanly absent"
    assert server_process.terminate() == 0


def _flip_payload_byte(ssd_dir, offset: int, where: int) -> None:
    with open(ssd_dir / "pages.dat", "r+b") as f:
        f.seek(offset + HEADER_BYTES + where)
        byte = f.read(1)
        f.seek(offset + HEADER_BYTES + where)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "grpc"])
async def test_flipped_byte_on_ssd_is_never_served_and_is_quarantined(server_factory, tmp_path, layout, ns, use_shm: bool) -> None:
    """A page read up from disk is checked once, where its bytes are consumed (DESIGN §4): a
    same-host reader's verified copy finds the damage (PageCorrupt) and reports it; a reader
    over gRPC, sent it unchecked, finds it as it lands (PageCorrupt) and reads it again
    checked, whose send finds it and quarantines it. Either way no byte of it reaches the
    caller, and the copy on disk, where the damage is, is quarantined: the next lookup stops
    before it instead of promising it again."""
    server = server_factory()
    tokens = list(range(160))
    kv = random_kv(layout, 160, seed=5)
    async with KVStoreClient(server.address, ns, use_shm=use_shm) as client:
        await client.put(tokens, kv, durable=True)
        hit = await client.lookup(tokens)
        bad = hit.keys[3]
        # Drop the host copies so the next read must come from disk.
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = directory_pb2_grpc.DirectoryStub(ch)
            await stub.Remove(directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=hit.keys, tier="host"))
        _flip_payload_byte(tmp_path / "ssd", server.core.where(bad)["ssd"], where=1234)
        hit = await client.lookup(tokens)
        assert hit.num_pages == 10 and {loc.tier for loc in hit.locations} == {"ssd"}
        out = torch.zeros_like(kv)
        with pytest.raises(PageCorrupt) as err:
            await client.get(hit, into=out)
        assert err.value.num_tokens == 48
        assert torch.equal(out[:, :, :48], kv[:, :, :48])
        # (a same-host get copies the pages after it meanwhile: intact bytes of their own pages)
        assert not out[:, :, 48:64].any(), "no byte of the corrupt page may reach the caller"
        # Quarantined at its source: the next lookup stops before it instead of stalling on it again.
        assert (await client.lookup(tokens)).num_tokens == 48
        assert server.core.where(bad) == {}
    quarantined = server.core.quarantined()
    assert {q.key for q in quarantined} == {bad} and all("checksum" in q.reason for q in quarantined)
    on_disk = next(tier for tier in server.core.tiers if tier.name == "ssd").quarantined()
    assert [q.key for q in on_disk] == [bad], "the damaged copy on disk is quarantined, not only the one read up"


@pytest.mark.parametrize(("use_shm", "chunk_bytes"), [(True, 4 << 20), (False, 4 << 20), (False, 4096)],
                         ids=["shm", "grpc-page-per-message", "grpc-chunks"])
async def test_corrupt_host_slot_is_detected_by_the_reader(server, layout, ns, use_shm: bool, chunk_bytes: int) -> None:
    """A stray write into the arena: the reader (same host or over the socket, a page whole
    or in chunks) finds the damage itself (PageCorrupt), stops at the damaged page, and no
    byte of it reaches the caller. Over the socket the pages come unchecked (the reader's
    check is their one hash, DESIGN §4) and the reader reads the failed one again checked:
    that send finds the damage and quarantines the page at the server."""
    tokens = list(range(64))
    kv = random_kv(layout, 64, seed=6)
    async with KVStoreClient(server.address, ns, use_shm=use_shm, chunk_bytes=chunk_bytes) as client:
        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        flip_arena_byte(server, server.core.where(hit.keys[2])["host"] + 100)  # a stray write into the arena
        out = torch.zeros_like(kv)
        with pytest.raises(PageCorrupt) as err:
            await client.get(hit, into=out)
        assert err.value.num_tokens == 32
        assert torch.equal(out[:, :, :32], kv[:, :, :32])
        assert not out[:, :, 32:48].any(), "no byte of the corrupt page may reach the caller"
        assert use_shm or hit.keys[2] in [q.key for q in server.core.quarantined()]


async def stored(client: KVStoreClient, tokens: list[int], kv: torch.Tensor) -> Hit:
    """``kv`` put through the arena, and the lookup of it."""
    assert client.shared_memory
    await client.put(tokens, kv)
    return await client.lookup(tokens)


async def test_a_page_a_same_host_reader_finds_corrupt_is_checked_and_quarantined(server, layout, ns) -> None:
    """Found by kvstore-bench chaos: a page whose arena bytes changed after it was stored failed
    every same-host reader's checksum, and every lookup still promised it (a miss disguised as
    a hit, for as long as the page stayed). The reader reports it at release; the server
    checks the bytes itself and quarantines the page, so the next lookup stops before it. A
    report of an intact page changes nothing (a client cannot get a good page dropped)."""
    tokens, kv = list(range(64)), random_kv(layout, 64, seed=6)
    async with KVStoreClient(server.address, ns) as client:
        hit = await stored(client, tokens, kv)
        lease = await client.transport.acquire(hit.keys)  # an honest client's false report: the page stays
        await client.transport.release(lease.lease_id, failed=[hit.keys[1]])
        assert (await client.lookup(tokens)).num_tokens == 64
        flip_arena_byte(server, server.core.where(hit.keys[2])["host"] + 100)
        with pytest.raises(PageCorrupt):
            await client.get(hit, into=torch.zeros_like(kv))
        assert [q.key for q in server.core.quarantined()] == [hit.keys[2]]
        again = await client.lookup(tokens)
        assert again.num_tokens == 32, "the page a reader found corrupt is promised no more"
        out = torch.zeros_like(kv)
        assert await client.get(again, into=out) == 32
        assert torch.equal(out[:, :, :32], kv[:, :, :32])


async def test_a_layerwise_load_names_the_corrupt_page_it_found(server, layout, ns) -> None:
    """As a get does (found by a review of 36c0631: the layer-wise load reported nothing)."""
    tokens, kv = list(range(64)), random_kv(layout, 64, seed=6)
    async with KVStoreClient(server.address, ns) as client:
        hit = await stored(client, tokens, kv)
        flip_arena_byte(server, server.core.where(hit.keys[2])["host"] + 100)
        load = client.load(hit, into=torch.zeros_like(kv), deadline_s=10.0)
        assert await load.finished() == 32
        assert [q.key for q in server.core.quarantined()] == [hit.keys[2]], "the layer-wise reader did not report the page"


async def test_pipelined_batches_keep_order_and_stop_at_a_corrupt_page(server_factory, layout, ns) -> None:
    """Many batches in flight at once (host tier of 128 pages, batches of 21): pages land in
    order, and a corrupt slot in a later batch ends the get exactly there."""
    server = server_factory(host_bytes=4 << 20, ssd_bytes=None)
    tokens = list(range(16 * 100))
    kv = random_kv(layout, len(tokens), seed=8)
    async with KVStoreClient(server.address, ns) as client:
        assert client.transport.batch_pages() < 30
        assert await client.put(tokens, kv) == len(tokens)
        hit = await client.lookup(tokens)
        out = torch.zeros_like(kv)
        await client.get(hit, into=out)
        assert torch.equal(out, kv)
        flip_arena_byte(server, server.core.where(hit.keys[70])["host"] + 7)
        out.zero_()
        with pytest.raises(PageCorrupt) as err:
            await client.get(hit, into=out)
        assert err.value.num_tokens == 70 * 16
        assert torch.equal(out[:, :, : 70 * 16], kv[:, :, : 70 * 16])
        assert not out[:, :, 70 * 16 : 71 * 16].any(), "no byte of the corrupt page may reach the caller"
        # No lease outlived the failed get: new pages can take every slot of the tier.
        other = list(range(100_000, 100_000 + 16 * 128))
        assert await client.put(other, random_kv(layout, len(other))) == len(other)


async def test_index_entry_without_bytes_is_dropped_at_start(server_process, tmp_path, layout, ns) -> None:
    server_process.start()
    tokens = list(range(64))
    async with KVStoreClient(server_process.address, ns) as client:
        await client.put(tokens, random_kv(layout, 64), durable=True)
    server_process.kill()
    with open(tmp_path / "ssd" / "pages.dat", "r+b") as f:  # noqa: ASYNC230 - lose the last page's bytes (server is down)
        f.truncate(f.seek(0, 2) - 4096)
    server_process.start()
    async with KVStoreClient(server_process.address, ns) as client:
        assert (await client.lookup(tokens)).num_tokens == 48


def test_ssd_slots_stay_aligned_for_any_capacity(tmp_path) -> None:
    """Regression: a capacity whose 64th part was not a multiple of 4 KiB gave unaligned
    slots, and O_DIRECT writes failed with EINVAL."""
    from kvstore.config import SsdTierConfig
    from kvstore.page import LayoutDesc, PageHeader, checksum
    from kvstore.tiers.ssd import SsdTier

    tier = SsdTier(SsdTierConfig(directory=tmp_path / "ssd", capacity_bytes=1_718_000_000))
    try:
        payload = bytes(range(256)) * 9216  # 2.25 MiB
        placed = []
        for i in range(40):
            header = PageHeader(b"n" * 16, i.to_bytes(16, "little"), LayoutDesc(36, 2, 8, 128, "bfloat16", 16), len(payload), checksum(payload))
            offset = tier.reserve(header.payload_bytes)
            assert offset is not None and offset % 4096 == 0
            tier.write([(offset, header, memoryview(payload))])
            placed.append((offset, header))
        tier.commit(placed)
        into = bytearray(len(payload))
        assert tier.read_into([((39).to_bytes(16, "little"), memoryview(into))]).num_read == 1 and bytes(into) == payload
    finally:
        tier.close()


def test_staged_ssd_reads_stop_at_a_damaged_page(tmp_path) -> None:
    """read_into stages each page in a shared buffer pair and verifies it as it is copied
    into place: the pages before a damaged one arrive bit-exact, the damaged one is named,
    and the buffers go back to the pool (a second pass of the same reads works)."""
    from kvstore.config import SsdTierConfig
    from kvstore.page import LayoutDesc, PageHeader, checksum
    from kvstore.tiers.ssd import SsdTier

    tier = SsdTier(SsdTierConfig(directory=tmp_path / "ssd", capacity_bytes=64 << 20))
    try:
        pages, placed = [], []
        for i in range(6):
            payload = bytes([i]) * 5000 + os.urandom(3192)  # 8 KiB, unaligned content
            layout = LayoutDesc(1, 2, 1, 2048, "float16", 1)
            header = PageHeader(b"n" * 16, i.to_bytes(16, "little"), layout, len(payload), checksum(payload))
            offset = tier.reserve(header.payload_bytes)
            assert offset is not None
            tier.write([(offset, header, memoryview(payload))])
            pages.append(payload)
            placed.append((offset, header))
        tier.commit(placed)
        dests = [bytearray(8192) for _ in pages]
        items = [(i.to_bytes(16, "little"), memoryview(d)) for i, d in enumerate(dests)]
        assert tier.read_into(items) == ReadResult(6)
        assert [bytes(d) for d in dests] == pages

        with open(tmp_path / "ssd" / "pages.dat", "r+b") as f:  # one byte of page 4's payload
            f.seek(placed[4][0] + HEADER_BYTES + 100)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))
        for _ in range(2):
            for d in dests:
                d[:] = bytes(8192)
            assert tier.read_into(items) == ReadResult(4, f"page {(4).to_bytes(16, 'little').hex()} failed its checksum")
            assert [bytes(d) for d in dests[:4]] == pages[:4]
        # Unverified (its reader checks the payload): every page lands, the damaged one as it is on disk ...
        assert tier.read_into(items, verify=False) == ReadResult(6)
        assert [bytes(d) for i, d in enumerate(dests) if i != 4] == pages[:4] + pages[5:] and bytes(dests[4]) != pages[4]
        with open(tmp_path / "ssd" / "pages.dat", "r+b") as f:  # ... but a header that does not match the index still ends it
            f.seek(placed[2][0] + 40)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))
        result = tier.read_into(items, verify=False)
        assert result.num_read == 2 and "header" in result.reason
    finally:
        tier.close()


async def test_a_page_damaged_in_the_arena_after_its_read_up_keeps_its_intact_copy_on_disk(server_factory, layout, ns) -> None:
    """The other half of checking a read-up page at its reader: the damage may be the arena's
    (a stray write after the read). The reader's report drops the arena copy; the disk copy,
    checked then, is intact and stays, and the next get reads it up again, bit-exact."""
    server = server_factory()
    tokens, kv = list(range(64)), random_kv(layout, 64, seed=7)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, kv, durable=True)
        hit = await client.lookup(tokens)
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = directory_pb2_grpc.DirectoryStub(ch)
            await stub.Remove(directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=hit.keys, tier="host"))
        out = torch.zeros_like(kv)
        await client.get(await client.lookup(tokens), into=out)  # read up from disk
        assert torch.equal(out, kv)
        flip_arena_byte(server, server.core.where(hit.keys[2])["host"] + 100)
        with pytest.raises(PageCorrupt):
            await client.get(await client.lookup(tokens), into=torch.zeros_like(kv))
        assert set(server.core.where(hit.keys[2])) == {"ssd"}, "the arena copy is dropped, the intact one on disk kept"
        again = await client.lookup(tokens)
        assert again.num_tokens == 64
        out = torch.zeros_like(kv)
        await client.get(again, into=out)
        assert torch.equal(out, kv)


def _limit_file_size() -> None:
    """In the server process: files may not grow past 12 MiB (EFBIG, like a full disk)."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (12 << 20, 12 << 20))


async def test_disk_full_is_a_clear_error_and_nothing_stored_is_lost(server_process, layout, ns) -> None:
    from kvstore.errors import TierUnavailable

    server_process.args += ["--host-capacity", "8MiB"]
    server_process.start(preexec_fn=_limit_file_size)
    first = list(range(16 * 100))
    kv = random_kv(layout, len(first), seed=31)
    async with KVStoreClient(server_process.address, ns) as client:
        assert await client.put(first, kv, durable=True) == len(first)  # ~3.4 MiB on disk
        more = list(range(100_000, 100_000 + 16 * 300))
        with pytest.raises(TierUnavailable, match="durable write failed on the ssd tier"):
            await client.put(more, random_kv(layout, len(more), seed=32), durable=True)
        hit = await client.lookup(first)
        assert hit.num_tokens == len(first)
        out = torch.empty_like(kv)
        await client.get(hit, into=out)
        assert torch.equal(out, kv)
        ram = list(range(900_000, 900_000 + 160))
        assert await client.put(ram, random_kv(layout, 160)) == 160, "the server keeps serving from RAM"
    assert server_process.terminate() == 0


async def test_scrub_finds_damage_and_ctl_lists_and_purges(server_factory, tmp_path, layout, ns, capsys) -> None:
    import json as _json

    from kvstore.cli import ctl

    server = server_factory()
    tokens = list(range(96))
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, random_kv(layout, 96, seed=41), durable=True)
        keys = client.keys(tokens)
    _flip_payload_byte(tmp_path / "ssd", server.core.where(keys[2])["ssd"], where=77)
    results = [server.core.scrub_one() for _ in range(6)]
    assert results.count(False) == 1 and results.count(True) == 5
    assert "ssd" not in server.core.where(keys[2])
    assert ctl.main(["--server", server.address, "--json", "quarantine"]) == 0
    listed = _json.loads(capsys.readouterr().out)
    assert listed["quarantined"] == 1 and listed["pages"][0]["key"] == keys[2].hex() and "scrub" in listed["pages"][0]["reason"]
    assert ctl.main(["--server", server.address, "--json", "quarantine", "--purge"]) == 0
    assert _json.loads(capsys.readouterr().out)["purged"] == 1
    assert server.core.quarantined() == []


async def test_damaged_arena_page_is_never_written_through(server, layout, ns) -> None:
    """A durable commit whose arena bytes do not match their checksum: the page is
    quarantined, nothing of the batch is indexed on ssd, and its ssd slots are free again."""
    tokens = list(range(64))
    kv = random_kv(layout, 64, seed=7)
    async with KVStoreClient(server.address, ns) as client:
        keys = client.keys(tokens)
        shm, io = client.transport, client.runtime
        alloc = await io.call(shm.allocate(keys))
        sums = [shm.write_slot(kv, None, i, slot.offset) for i, slot in enumerate(alloc.slots)]
        sums[2] ^= 1  # the client's bytes and its checksum disagree for page 2
        with pytest.raises(PageCorrupt):
            await io.call(shm.commit(alloc.allocation_id, keys, sums, durable=True))
        assert not any("ssd" in server.core.where(k) for k in keys) and server.core.view().tiers["ssd"].used_bytes == 0
        assert [q.key for q in server.core.quarantined()] == [keys[2]]
        assert (await client.lookup(tokens)).num_tokens == 2 * layout.page_tokens  # pages 0-1 stay in RAM


async def test_ids_from_before_a_restart_name_nothing_after_it(server_process, layout, ns) -> None:
    """Bug: lease and allocation ids counted from 1 in every server process, so after a
    restart a client still holding an id from before (a layer-wise load renewing its
    lease, a put whose Commit or Abort was in flight) named another caller's lease or
    allocation: its Renew kept that lease alive, its Release freed that caller's pins, its
    Abort freed that caller's slots while they were being written."""
    server_process.start()
    tokens = list(range(64))
    async with KVStoreClient(server_process.address, ns) as client:
        assert await client.put(tokens, random_kv(layout, 64, seed=41), durable=True) == 64
        keys = client.keys(tokens)
    acquire = data_pb2.AcquireRequest(namespace_id=ns.namespace_id, keys=keys, ttl_ms=60_000)
    with grpc.insecure_channel(server_process.address) as channel:
        data = data_pb2_grpc.DataStub(channel)
        old = [data.Acquire(acquire, timeout=10).lease_id for _ in range(4)]
        old += [data.Allocate(data_pb2.AllocateRequest(namespace_id=ns.namespace_id, layout=layout_msg(LayoutDesc.of(layout)),
                                                       keys=[bytes(16)]), timeout=10).allocation_id]
    server_process.kill()
    server_process.start()
    with grpc.insecure_channel(server_process.address) as channel:
        data = data_pb2_grpc.DataStub(channel)
        new = [data.Acquire(acquire, timeout=10).lease_id for _ in range(8)]
        new += [data.Allocate(data_pb2.AllocateRequest(namespace_id=ns.namespace_id, layout=layout_msg(LayoutDesc.of(layout)),
                                                       keys=[(i + 1).to_bytes(16, "big")]), timeout=10).allocation_id
                for i in range(8)]
        assert not set(old) & set(new), "an id from before the restart names a lease or allocation after it"
        with pytest.raises(grpc.RpcError) as err:
            data.Renew(data_pb2.RenewRequest(lease_id=old[0], ttl_ms=60_000), timeout=10)
        assert err.value.code() == grpc.StatusCode.ABORTED
