"""Mooncake Store's remote get over TCP on loopback, for the cluster benchmark's peer column:
a ``mooncake_master`` (with its HTTP metadata server), a holder process that mounts a
segment and puts the pages, and a reader process (no segment of its own) that times
``batch_get_into`` of the same number of pages of the same size into a registered buffer,
so every byte crosses the transfer engine's TCP transport. Each Mooncake process is a
child of its own: the bench process never loads Mooncake's libraries.

``remote_get_gbps`` returns (GB/s, None) or (None, the reason it could not run, e.g. the
import error of the ``mooncake-transfer-engine-non-cuda`` wheel).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from kvstore.bench.common.harness import free_port, stop_process


def _setup(store: object, metadata: str, master: str, segment_bytes: int, buffer_bytes: int) -> None:
    rc = store.setup("127.0.0.1", metadata, segment_bytes, buffer_bytes, "tcp", "", master)  # type: ignore[attr-defined]
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")


def _holder(metadata: str, master: str, page_bytes: int, pages: int) -> None:
    """Child: mounts a segment holding the pages, puts them, prints 'ready', waits for stdin to close."""
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    _setup(store, metadata, master, 2 * pages * page_bytes + (64 << 20), pages * page_bytes + (16 << 20))
    src = np.random.default_rng(0).integers(0, 256, pages * page_bytes, dtype=np.uint8)
    ptr = src.ctypes.data
    if store.register_buffer(ptr, src.nbytes) != 0:
        raise RuntimeError("register_buffer failed")
    keys = [f"page-{i}" for i in range(pages)]
    rcs = store.batch_put_from(keys, [ptr + i * page_bytes for i in range(pages)], [page_bytes] * pages)
    if any(rc != 0 for rc in rcs):
        raise RuntimeError(f"batch_put_from failed: {rcs}")
    print("ready", flush=True)
    sys.stdin.read()
    store.close()


def _reader(metadata: str, master: str, page_bytes: int, pages: int, rounds: int) -> None:
    """Child: gets every page ``rounds`` times after a warm-up round (its bytes checked); prints GB/s."""
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    _setup(store, metadata, master, 0, pages * page_bytes + (16 << 20))
    dst = np.zeros(pages * page_bytes, dtype=np.uint8)
    ptr = dst.ctypes.data
    if store.register_buffer(ptr, dst.nbytes) != 0:
        raise RuntimeError("register_buffer failed")
    keys = [f"page-{i}" for i in range(pages)]
    ptrs, sizes = [ptr + i * page_bytes for i in range(pages)], [page_bytes] * pages
    for r in range(rounds + 1):
        if r == 1:
            t0 = time.perf_counter()
        got = store.batch_get_into(keys, ptrs, sizes)
        if any(n != page_bytes for n in got):
            raise RuntimeError(f"batch_get_into returned {got[:4]}...")
        if r == 0 and not np.array_equal(dst, np.random.default_rng(0).integers(0, 256, dst.nbytes, dtype=np.uint8)):
            raise RuntimeError("Mooncake returned other bytes than the holder put")
    print(rounds * pages * page_bytes / (time.perf_counter() - t0) / 1e9, flush=True)
    store.close()


def _child(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvstore.bench.cluster.cluster_mooncake", *args]


def unavailable() -> str | None:
    """Why Mooncake Store cannot run here (None: it can), checked in a child process."""
    probe = subprocess.run([sys.executable, "-c", "from mooncake.store import MooncakeDistributedStore"],
                           capture_output=True, text=True, timeout=60, check=False)
    if probe.returncode != 0:
        last = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else str(probe.returncode)
        hint = ""
        if "libibverbs" in last or "librdmacm" in last:  # the wheel links the RDMA libraries even for TCP
            hint = " (the wheel needs the RDMA user libraries even for TCP: apt-get install libibverbs1 librdmacm1)"
        return f"mooncake.store does not import: {last}{hint}"
    return None


def remote_get_gbps(workdir: Path, page_bytes: int, pages: int, rounds: int) -> tuple[float | None, str | None]:
    reason = unavailable()
    if reason is not None:
        return None, reason
    import mooncake

    master_exe = Path(mooncake.__file__).parent / "mooncake_master"
    rpc, http = free_port(), free_port()
    metadata, master = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
    env = {**os.environ, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "WARNING")}
    with open(workdir / "mooncake.log", "ab") as log:
        procs = [subprocess.Popen([str(master_exe), f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                                   f"--http_metadata_server_port={http}", "--http_metadata_server_host=127.0.0.1",
                                   f"--metrics_port={free_port()}", "--enable_metric_reporting=false"],
                                  stdout=log, stderr=log, env=env)]
        try:
            time.sleep(1.0)  # the master prints nothing to wait on; its ports open within a second
            holder = subprocess.Popen(_child("--holder", metadata, master, str(page_bytes), str(pages)), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            procs.append(holder)
            assert holder.stdout is not None
            if "ready" not in holder.stdout.readline():
                return None, f"the Mooncake holder did not start; see {workdir / 'mooncake.log'}"
            out = subprocess.run(_child("--reader", metadata, master, str(page_bytes), str(pages), str(rounds)),
                                 capture_output=True, text=True, timeout=300, env=env, check=False)
            if out.returncode != 0:
                return None, f"the Mooncake reader failed: {out.stderr.strip()[-500:]}"
            return float(out.stdout.strip().splitlines()[-1]), None
        finally:
            for proc in reversed(procs):
                if proc.stdin is not None:
                    proc.stdin.close()
                stop_process(proc, 10)


if __name__ == "__main__":
    if sys.argv[1] == "--holder":
        _holder(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1] == "--reader":
        _reader(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
