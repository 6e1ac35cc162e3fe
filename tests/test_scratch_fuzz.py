from __future__ import annotations
import random
import grpc
from conftest import make_config, random_kv
from kvstore._proto import common_pb2, data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.validate import layout_msg
from kvstore.page import LayoutDesc
from kvstore.wire import page_chunks

async def test_structured_fuzz(server_factory, tmp_path, layout, ns) -> None:
    server = server_factory(make_config(tmp_path, host_bytes=8 << 20))
    import os; rng = random.Random(int(os.environ.get("SEED", "5")))
    tokens = list(range(16 * 32))
    kv = random_kv(layout, len(tokens), seed=1)
    async with KVStoreClient(server.address, ns) as c:
        await c.put(tokens[: 16 * 16], kv[:, :, : 16 * 16], durable=True)
        await c.put(tokens, kv)
        keys = c.keys(tokens)
    lm = layout_msg(LayoutDesc.of(layout))
    nsid = ns.namespace_id
    leases, allocs = [], []
    codes = {}
    def rkeys():
        k = list(keys)
        rng.shuffle(k) if rng.random() < 0.2 else None
        n = rng.choice([0, 1, 5, 32, 33])
        out = k[:n]
        if rng.random() < 0.3:
            out += [rng.randbytes(16) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.1:
            out += [rng.randbytes(rng.choice([0, 15, 17]))]
        return out
    def rttl():
        return rng.choice([0, 1, 100, 30000, 600000, 600001, 2**32 - 1])
    def rid():
        pool = leases + allocs + [0, 1, 2**64 - 1]
        return rng.choice(pool)
    with grpc.insecure_channel(server.address) as ch:
        d, r = data_pb2_grpc.DataStub(ch), directory_pb2_grpc.DirectoryStub(ch)
        for i in range(3000):
            last = None
            kind = rng.choice(["acq", "read", "alloc", "commit", "abort", "renew", "release", "lease", "rlease", "hint", "write", "lookup", "remove"])
            try:
                if kind == "acq":
                    resp = d.Acquire(data_pb2.AcquireRequest(namespace_id=nsid, keys=rkeys(), ttl_ms=rttl()), timeout=10)
                    leases.append(resp.lease_id)
                elif kind == "read":
                    for _ in d.ReadPages(data_pb2.ReadPagesRequest(namespace_id=nsid, keys=rkeys(), ttl_ms=rttl(), chunk_bytes=rng.choice([0, 4096, 100, 1 << 30])), timeout=10):
                        if rng.random() < 0.3:
                            break
                elif kind == "alloc":
                    l = lm if rng.random() < 0.8 else common_pb2.Layout(num_layers=rng.randint(0, 5), kv_factor=2, num_kv_heads=2, head_dim=64, dtype="float16", page_tokens=16)
                    resp = d.Allocate(data_pb2.AllocateRequest(namespace_id=nsid, layout=l, keys=rkeys()), timeout=10)
                    allocs.append(resp.allocation_id)
                elif kind == "commit":
                    ks = rkeys()
                    sums = [rng.randrange(2**64) for _ in ks] if rng.random() < 0.8 else [1]
                    d.Commit(data_pb2.CommitRequest(allocation_id=rid(), keys=ks, checksums=sums, durable=rng.random() < 0.5, flags=rng.randrange(2**32)), timeout=10)
                elif kind == "abort":
                    d.Abort(data_pb2.AbortRequest(allocation_id=rid()), timeout=10)
                elif kind == "renew":
                    d.Renew(data_pb2.RenewRequest(lease_id=rid(), ttl_ms=rttl()), timeout=10)
                elif kind == "release":
                    d.Release(data_pb2.ReleaseRequest(lease_id=rid()), timeout=10)
                elif kind == "lease":
                    resp = r.Lease(directory_pb2.LeaseRequest(namespace_id=nsid, keys=rkeys(), ttl_ms=rttl()), timeout=10)
                    leases.append(resp.lease_id)
                elif kind == "rlease":
                    r.ReleaseLease(directory_pb2.ReleaseLeaseRequest(lease_id=rid()), timeout=10)
                elif kind == "hint":
                    d.Hint(data_pb2.HintRequest(namespace_id=nsid, entries=[data_pb2.HintEntry(keys=rkeys(), eta_ms=rng.choice([0, 10, 3600000, 3600001, 2**32-1]))]), timeout=10)
                elif kind == "write":
                    ks = rkeys()[:3]
                    def gen():
                        for k in ks:
                            data = bytes(LayoutDesc.of(layout).page_bytes)
                            cs = None if rng.random() < 0.7 else 123
                            chunks = list(page_chunks(k, nsid, lm, memoryview(data), cs, rng.random() < 0.3, rng.choice([4096, 1 << 22])))
                            if rng.random() < 0.2:
                                chunks = chunks[: rng.randrange(len(chunks) + 1)]
                            yield from chunks
                    ch.stream_unary('/kvstore.v1.Data/WritePages', request_serializer=None, response_deserializer=data_pb2.WritePagesResponse.FromString)(gen(), timeout=10)
                elif kind == "lookup":
                    r.Lookup(directory_pb2.LookupRequest(namespace_id=nsid, keys=rkeys()), timeout=10)
                elif kind == "remove":
                    if rng.random() < 0.05:
                        r.Remove(directory_pb2.RemoveRequest(namespace_id=nsid, keys=rkeys(), tier=rng.choice(["", "host", "ssd", "x"])), timeout=10)
                codes[(kind, "OK")] = codes.get((kind, "OK"), 0) + 1
            except grpc.RpcError as exc:
                codes[(kind, exc.code().name)] = codes.get((kind, exc.code().name), 0) + 1
                last = (exc.code().name, exc.details())
                if exc.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED):
                    print("BAD", kind, exc.code(), exc.details())
            u = server.manager.host.usage()
            reserved = sum(len(a.slots) for a in server.manager._allocations.values())
            if u.used_bytes != (u.num_pages + reserved) * 32768 and not getattr(server, "_seen", False):
                server._seen = True
                print("LEAK after", i, kind, u, reserved, last)
        for l in leases:
            d.Release(data_pb2.ReleaseRequest(lease_id=l), timeout=10)
        for a in allocs:
            d.Abort(data_pb2.AbortRequest(allocation_id=a), timeout=10)
        stats = r.Stats(directory_pb2.StatsRequest(), timeout=10)
    print(sorted(codes.items()))
    m = server.manager
    print("pins", len(m._pins), "allocs", len(m._allocations), "leases", len(m._leases), "streams", server.streams.num_open, "num_leases", stats.num_leases)
    print("host pages", m.host.usage(), "layouts", m._layouts.keys())
    assert not m._pins and not m._allocations and not m._leases
