"""A tenant at its host_bytes quota (DESIGN §11): its own coldest pages make room, never another
tenant's; it is refused (LimitExceeded) only when its own are pinned or reserved, after passes
that stop at the pins, at its caller's deadline, and hold nothing for a caller that left; many
of its calls at once at the quota are all served. Real server, TLS, tokens (tenants.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
import pytest
from support.tenants import LAYOUT, PAGE_BYTES, A, B, Caller, new_keys, new_ns, start_with_quotas

from kvstore._proto import data_pb2
from kvstore.errors import QuotaExceeded
from kvstore.status import ERROR_METADATA_KEY, error_for

pytest_plugins = ["support.tenants"]  # its ca fixture

FULL = grpc.StatusCode.RESOURCE_EXHAUSTED
OK = grpc.StatusCode.OK


def _error_label(exc: Any) -> str | None:
    """The error class (and its fields) the server named in the trailing metadata."""
    return next((str(v) for k, v in exc.trailing_metadata() or () if k == ERROR_METADATA_KEY), None)


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "grpc"])
async def test_a_client_at_its_host_quota_with_its_pages_pinned_gets_limit_exceeded(tmp_path, ca, use_shm: bool) -> None:
    """Bug (found by kvstore-bench soak with a host_bytes quota per tenant): the server names
    the class it raised (HostQuotaFull) and the client built it with the message alone; its
    constructor also takes keep_bytes, so the client raised TypeError, which no caller catches
    (a soak client died of it), instead of the LimitExceeded a full quota is."""
    from support.kv import random_kv

    from kvstore.client import ClientTLS, KVStoreClient
    from kvstore.errors import LimitExceeded
    from kvstore.types import KVLayout, Namespace

    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, page_tokens=4)
    server = start_with_quotas(tmp_path, ca, {"a": {"host_bytes": 2 * layout.page_bytes}})
    try:
        async with KVStoreClient(server.address, Namespace("m", "r1", layout), token=A, tls=ClientTLS(ca=ca.cert),
                                 use_shm=use_shm) as client:
            tokens = list(range(2 * layout.page_tokens))
            assert await client.put(tokens, random_kv(layout, len(tokens))) == len(tokens)
            hit = await client.lookup(tokens)
            a = Caller(server, ca, A)
            a(a.data.Acquire, data_pb2.AcquireRequest(namespace_id=hit.namespace_id, keys=hit.keys))  # all of a's pages, pinned
            more = list(range(100, 100 + layout.page_tokens))
            with pytest.raises(LimitExceeded, match="host bytes") as refused:
                await client.put(more, random_kv(layout, len(more)))
            # the refusal's figures come as fields, whichever transport carried it (DESIGN §11)
            assert isinstance(refused.value, QuotaExceeded), type(refused.value).__name__
            assert (refused.value.tenant, refused.value.quota, refused.value.limit) == ("a", "host_bytes", 2 * layout.page_bytes)
            assert (refused.value.held, refused.value.wanted, refused.value.freed) == (2 * layout.page_bytes, layout.page_bytes, 0)
    finally:
        server.stop(grace_s=1)


@pytest.mark.parametrize("share_arena", [False, True], ids=["own-arenas", "shared-arena"])
def test_a_refusal_at_the_host_quota_walks_its_pinned_pages_once_and_leaves_the_others_pages(tmp_path, ca, monkeypatch,
                                                                                            share_arena: bool) -> None:
    """A tenant whose own pages are all pinned is refused at its host quota after one eviction
    pass that finds nothing to evict: another pass (under the placement lock every tenant's
    calls wait for, walking the arena's eviction order) finds the same pins. Bug: the
    ROOM_TRIES loop made ROOM_TRIES passes for every such refusal, so a tenant that pins its
    pages and keeps asking cost the server four walks a call. Another tenant's pages stay,
    with a shared arena too (evict_own passes over them)."""
    server = start_with_quotas(tmp_path, ca, {"a": {"host_bytes": 4 * PAGE_BYTES}}, share_arena=share_arena)
    passes: list[bool] = []
    evict_own = server.core.evict_own

    def counted(*args: Any) -> Any:
        passes.append(True)
        return evict_own(*args)

    monkeypatch.setattr(server.core, "evict_own", counted)
    try:
        a, b = Caller(server, ca, A), Caller(server, ca, B)
        ns_a, ns_b, keys_a, keys_b = new_ns(), new_ns(), new_keys(4), new_keys(8)
        assert a.put(ns_a, keys_a) == 4 and b.put(ns_b, keys_b) == 8
        a(a.data.Acquire, data_pb2.AcquireRequest(namespace_id=ns_a, keys=keys_a))  # all of a's pages, pinned
        passes.clear()
        allocate = data_pb2.AllocateRequest(namespace_id=ns_a, layout=LAYOUT, keys=new_keys(1))
        for _ in range(5):
            assert a.code(a.data.Allocate, allocate) == FULL
        assert len(passes) == 5, f"{len(passes)} eviction passes for 5 refusals (every pass found only pinned pages)"
        use = server.tenancy.quotas.usage("a", ["host_bytes", "allocations"])
        assert use == {"host_bytes": 4 * PAGE_BYTES, "allocations": 0}, "the refusals left no slot or charge"
        assert not +server.tenancy.quotas._reserved["a"], "nor a reservation"
        assert b.lookup(ns_b, keys_b) == 8, "the other tenant's pages stay"
        a.close()
        b.close()
    finally:
        server.stop(grace_s=1)


def test_an_allocate_whose_caller_left_during_its_eviction_passes_holds_nothing(tmp_path, ca, monkeypatch) -> None:
    """A caller at its host quota whose deadline passes while its Allocate makes room (passes
    that write pages down to a slow disk; ROOM_TRIES of them) gets DEADLINE_EXCEEDED and never
    hears of the allocation: it must not stay behind, holding slots and the tenant's host
    bytes and allocations quota until its TTL. Bug: the servicer went on, allocated, and
    answered nobody (the call socket undoes such an Allocate; gRPC did not)."""
    import time

    server = start_with_quotas(tmp_path, ca, {"a": {"host_bytes": 4 * PAGE_BYTES}})
    evict_own = server.core.evict_own

    def slow(*args: Any) -> Any:
        time.sleep(0.3)  # a write down to a busy disk
        return evict_own(*args)

    monkeypatch.setattr(server.core, "evict_own", slow)
    try:
        a = Caller(server, ca, A)
        ns = new_ns()
        assert a.put(ns, new_keys(4)) == 4
        with pytest.raises(grpc.RpcError) as err:
            a(a.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=new_keys(2)), timeout=0.15)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 10  # the handler ends ~0.3 s after its caller left (longer on a slow host)
        while (use := server.tenancy.quotas.usage("a"))["allocations"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert use["allocations"] == 0, f"an allocation nobody heard of is held: {use}"
        assert use["host_bytes"] <= 4 * PAGE_BYTES
        a.close()
    finally:
        server.stop(grace_s=1)


def test_a_put_at_the_host_quota_beside_a_durable_commit_evicts_only_what_it_needs(tmp_path, ca, monkeypatch) -> None:
    """Quota 4 pages: 3 stored, a durable put of a 4th in flight (published, its write to the
    SSD tier under way), then an Allocate of 1 page: 5 pages would be held, so one old page
    must go. Bug: the commit's bridge (the slots' bytes held while they become pages) stayed
    reserved after the page was published until the commit returned, so for the whole SSD
    write the page counted twice; keep_bytes came out a page short and the put evicted two
    of the tenant's pages where one was needed (the demoter may evict besides: keep_bytes,
    what the put asks, is checked)."""
    import threading

    server = start_with_quotas(tmp_path, ca, {"a": {"host_bytes": 4 * PAGE_BYTES}})
    write_through = server.core.moves.write_through
    writing, go_on = threading.Event(), threading.Event()

    def slow(keys: list[bytes]) -> None:  # a busy disk: the write waits until the Allocate below was answered
        writing.set()
        go_on.wait(10)
        write_through(keys)

    monkeypatch.setattr(server.core.moves, "write_through", slow)
    keeps: list[int] = []
    evict_own = server.core.evict_own

    def recorded(namespace_ids: frozenset[bytes], keep_bytes: int, parent: bytes | None = None) -> bool:
        keeps.append(keep_bytes)
        return evict_own(namespace_ids, keep_bytes, parent)

    monkeypatch.setattr(server.core, "evict_own", recorded)
    try:
        a = Caller(server, ca, A)
        ns = new_ns()
        for _ in range(3):
            assert a.put(ns, new_keys(1)) == 1  # three pages, no chain: each can go alone
        durable = threading.Thread(target=a.put, args=(ns, new_keys(1), True))
        durable.start()
        assert writing.wait(10), "the durable put did not reach its write"  # its page published, its write under way
        assert a.code(a.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=new_keys(1))) == OK
        go_on.set()
        durable.join(10)
        assert keeps == [3 * PAGE_BYTES], f"evicted down to {[k // PAGE_BYTES for k in keeps]} pages: 3 of 4 may stay"
        a.close()
    finally:
        go_on.set()
        server.stop(grace_s=1)


def test_a_refusal_after_its_own_pages_went_down_says_so(tmp_path, ca) -> None:
    """A tenant at its host quota with half its pages pinned asks for more than the other half
    frees: the eviction pass writes its two unpinned pages down, then the call is refused. Bug:
    the refusal said "nothing was done" though two of its pages had left the host tier."""
    server = start_with_quotas(tmp_path, ca, {"a": {"host_bytes": 4 * PAGE_BYTES}})
    try:
        a = Caller(server, ca, A)
        ns, keys = new_ns(), new_keys(4)
        assert a.put(ns, keys) == 4
        a(a.data.Acquire, data_pb2.AcquireRequest(namespace_id=ns, keys=keys[:2]))  # two pinned, two free to go
        with pytest.raises(grpc.RpcError) as refused:
            a(a.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=new_keys(4)))
        assert refused.value.code() == FULL
        details = refused.value.details() or ""
        assert "nothing was done" not in details, details
        assert f"{2 * PAGE_BYTES} bytes of its own pages were written down" in details, details
        exc = error_for(FULL, details, _error_label(refused.value))
        assert isinstance(exc, QuotaExceeded) and (exc.quota, exc.freed) == ("host_bytes", 2 * PAGE_BYTES), exc
        assert server.core.directory.usage(ns).get("host", 0) == 2 * PAGE_BYTES, "the two unpinned pages went down"
        a.close()
    finally:
        server.stop(grace_s=1)


def test_host_bytes_with_many_writers_at_the_quota(tmp_path, ca) -> None:
    """Many calls of one tenant at its host quota at once: each makes room by writing its own
    pages down, and the others take that room meanwhile. None is refused while the tenant
    has pages that are not pinned (the soak's secure phase saw one LimitExceeded in 11,667
    puts: a call lost the race ROOM_TRIES times)."""
    server = start_with_quotas(tmp_path, ca, {"a": {"host_bytes": 64 * PAGE_BYTES}})  # more than the 12 x 2 pages in flight
    try:
        errors: list[str] = []
        done = 0
        lock = threading.Lock()
        end = time.monotonic() + 6

        def writer() -> None:
            nonlocal done
            a = Caller(server, ca, A)
            ns = new_ns()
            try:
                while time.monotonic() < end:
                    try:
                        a.put(ns, new_keys(2))
                    except grpc.RpcError as exc:
                        with lock:
                            errors.append(f"{exc.code().name}: {exc.details()}")
                    with lock:
                        done += 1
            finally:
                a.close()

        threads = [threading.Thread(target=writer) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert done > 100, done
        assert errors == [], f"{len(errors)} of {done} puts refused at the quota: {errors[:2]}"
    finally:
        server.stop(grace_s=1)


def test_host_bytes_with_many_shm_clients_at_the_quota(tmp_path, ca) -> None:
    """The same over shared memory (Allocate on the call socket), as the soak's tenants put:
    8 clients of one tenant, each putting prompts that share prefixes, at a host quota that
    every put crosses."""
    from support.kv import random_kv

    from kvstore import KVLayout, Namespace
    from kvstore.client import ClientTLS, KVStoreClient
    from kvstore.errors import KVStoreError

    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, page_tokens=4)
    server = start_with_quotas(tmp_path, ca, {"a": {"host_bytes": 48 * layout.page_bytes}})
    errors: list[str] = []

    async def one(client: KVStoreClient, seed: int, end: float) -> int:
        import random

        rng, puts = random.Random(seed), 0
        while time.monotonic() < end:
            tokens = [7] * 4 + [rng.randrange(1 << 30) for _ in range(4 * rng.randrange(1, 4))]
            try:
                await client.put(tokens, random_kv(layout, len(tokens), seed=puts))
            except KVStoreError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            puts += 1
        return puts

    async def main() -> int:
        ns = Namespace("m", "r1", layout)
        tls = ClientTLS(ca=ca.cert)
        clients = [KVStoreClient(server.address, ns, token=A, tls=tls) for _ in range(8)]
        for client in clients:
            await client.connect()
        try:
            end = time.monotonic() + 8
            return sum(await asyncio.gather(*(one(c, i, end) for i, c in enumerate(clients))))
        finally:
            for client in clients:
                await client.close()

    try:
        puts = asyncio.run(main())
        assert puts > 200, puts
        assert errors == [], f"{len(errors)} of {puts} puts refused at the quota: {errors[:2]}"
    finally:
        server.stop(grace_s=1)


def test_a_landing_whose_fetch_was_cut_stops_making_room(tmp_path, ca, monkeypatch) -> None:
    """A fetch for tenant a (a fill, a replica) lands within its host quota (QuotaLanding): at the quota
    its allocate makes room, up to ROOM_TRIES eviction passes a try, halving what it asks for between
    tries. A fetch cut at its caller's deadline is waited for to the end (its commit must settle the
    namespace's binding), so a landing still making room holds that caller's thread: once cut, it must
    stop at the next pass. Here every pass reports room made that the quota never shows (a write down to
    a disk the tenant's other calls refill at once), and the cut comes in the first pass."""
    from kvstore import validate
    from kvstore.errors import LimitExceeded
    from kvstore.security.identity import Identity, Rights
    from kvstore.server.tenancy.fetch_room import QuotaLanding

    server = start_with_quotas(tmp_path, ca, {"a": {"host_bytes": 4 * PAGE_BYTES}})
    try:
        a = Caller(server, ca, A)
        ns, chain = new_ns(), new_keys(4)
        assert a.put(ns, chain) == 4
        who = Identity("a", Rights.READ | Rights.WRITE, b"")
        fetched = new_keys(4)
        landing = QuotaLanding(server.tenancy.quotas, server.core, who, ns, fetched)
        passes: list[bool] = []

        def busy(*args: Any) -> bool:
            passes.append(True)
            landing.cut()  # the caller's deadline passed during the first pass
            return True

        monkeypatch.setattr(server.core, "evict_own", busy)
        with pytest.raises(LimitExceeded):
            landing.allocate(ns, validate.layout(LAYOUT), fetched, server.core.directory.generation(ns))
        assert len(passes) == 1, f"{len(passes)} eviction passes after the fetch was cut"
        use = server.tenancy.quotas.usage("a", ["host_bytes", "allocations"])
        assert use == {"host_bytes": 4 * PAGE_BYTES, "allocations": 0}, "nothing held"
        a.close()
    finally:
        server.stop(grace_s=1)
