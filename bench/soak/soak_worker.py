"""One soak client process (soak.py starts them): a mixed put / lookup / get / layer-wise
save and load loop on one namespace of its tenant, every byte read checked.

More: bench/soak/README.md (### soak_worker.py).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from kvstore import KVLayout, Namespace
from kvstore.client import KVStoreClient
from kvstore.client.hit import Hit
from kvstore.errors import KVStoreError, PageMissing
from kvstore.security.channel import ClientTLS

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)  # 32 KiB pages
PAGE_SHAPE = (LAYOUT.num_layers, 2, LAYOUT.page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
MAX_ERRORS_KEPT = 20


def prompt_tokens(prompt: int) -> list[int]:
    """Prompt ``prompt``'s tokens: a shared base (one of 16), then pages of its own."""
    base = prompt % 16
    shared = [base * 1_000_000 + i for i in range((1 + base % 4) * LAYOUT.page_tokens)]
    own = [100_000_000 + prompt * 1000 + i for i in range((1 + prompt % 8) * LAYOUT.page_tokens)]
    return shared + own


def expected_kv(keys: list[bytes]) -> torch.Tensor:
    """The KV whose page i is the bytes seeded by ``keys[i]``."""
    pages = []
    for key in keys:
        data = bytearray(np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(LAYOUT.page_bytes))
        pages.append(torch.frombuffer(data, dtype=LAYOUT.dtype).view(PAGE_SHAPE))
    return torch.cat(pages, dim=2)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


class Loop:
    """The op mix of one client in one phase; samples are (seconds since start, op, latency_s)."""

    def __init__(self, client: KVStoreClient, rng: random.Random, num_prompts: int, start: float, measure_from: float) -> None:
        self.client, self.rng, self.num_prompts, self.start = client, rng, num_prompts, start
        self.measure_from = measure_from  # seconds since start: the measured window (hit counts)
        self.recent: deque[int] = deque(maxlen=64)  # prompts this client put lately: likely still stored
        self.samples: list[tuple[float, str, float]] = []
        self.counts = {"errors": 0, "wrong_bytes": 0, "misses": 0, "short_loads": 0, "short_puts": 0, "verified_tokens": 0,
                       "window_lookups": 0, "window_lookup_hits": 0, "window_tokens_asked": 0, "window_tokens_hit": 0}
        self.error_samples: list[str] = []

    def _timed(self, op: str, began: float) -> None:
        now = time.time()
        self.samples.append((began - self.start, op, now - began))

    async def lookup(self, tokens: list[int]) -> Hit:
        """A timed lookup, counted in the hit figures when it begins in the measured window."""
        began = time.time()
        hit = await self.client.lookup(tokens)
        self._timed("lookup", began)
        if began - self.start >= self.measure_from:
            c = self.counts
            c["window_lookups"] += 1
            c["window_lookup_hits"] += hit.num_tokens > 0
            c["window_tokens_asked"] += len(tokens)
            c["window_tokens_hit"] += hit.num_tokens
        return hit

    def _prompt(self, recent: bool) -> tuple[list[int], list[bytes]]:
        prompt = self.rng.choice(self.recent) if recent and self.recent else self.rng.randrange(self.num_prompts)
        tokens = prompt_tokens(prompt)
        return tokens, self.client.keys(tokens)

    async def put(self, layerwise: bool) -> None:
        prompt = self.rng.randrange(self.num_prompts)
        tokens = prompt_tokens(prompt)
        kv = expected_kv(self.client.keys(tokens))
        began = time.time()
        if layerwise:
            save = self.client.save(tokens, kv)
            for layer in range(LAYOUT.num_layers):
                save.layer_done(layer)
            stored = await save.finished(timeout_s=60)
        else:
            stored = await self.client.put(tokens, kv)
        self._timed("save" if layerwise else "put", began)
        self.counts["short_puts"] += stored != len(tokens)
        self.recent.append(prompt)

    async def read(self, layerwise: bool) -> None:
        tokens, keys = self._prompt(recent=self.rng.random() < 0.8)
        hit = await self.lookup(tokens)
        if not hit.num_tokens:
            return
        expected = expected_kv(keys[: hit.num_pages])
        into = torch.zeros_like(expected)
        began = time.time()
        if layerwise:
            load = self.client.load(hit, into=into, deadline_s=30)
            for layer in range(LAYOUT.num_layers):
                load.wait(layer)
            got = await load.finished()
            self._timed("load", began)
            self.counts["short_loads"] += got < hit.num_tokens
        else:
            try:
                got = await self.client.get(hit, into=into)
            except PageMissing as exc:  # evicted between the lookup and the read: allowed, prefix valid
                self.counts["misses"] += 1
                got = getattr(exc, "num_tokens", 0)
            else:
                self._timed("get", began)
        if not _same(into[:, :, :got], expected[:, :, :got]):
            self.counts["wrong_bytes"] += 1
            self._error(f"WRONG BYTES in the first {got} tokens of a {'load' if layerwise else 'get'}")
        self.counts["verified_tokens"] += got

    async def one(self) -> None:
        roll = self.rng.random()
        try:
            if roll < 0.35:
                await self.put(layerwise=False)
            elif roll < 0.42:
                await self.put(layerwise=True)
            elif roll < 0.62:
                await self.lookup(self._prompt(recent=False)[0])
            else:
                await self.read(layerwise=roll >= 0.92)
        except (KVStoreError, TimeoutError) as exc:
            self._error(f"{type(exc).__name__}: {exc}")

    def _error(self, text: str) -> None:
        self.counts["errors"] += 1
        if len(self.error_samples) < MAX_ERRORS_KEPT:
            self.error_samples.append(text)


async def run_phase(phase: dict[str, Any], conn: Connection, index: int) -> dict[str, Any]:
    ns = Namespace(model=f"soak-{phase['tenant']}", revision=phase["revision"], layout=LAYOUT)
    tls = ClientTLS(ca=phase["tls_ca"]) if phase.get("tls_ca") else None
    async with KVStoreClient(phase["address"], ns, use_shm=phase["use_shm"], token=phase.get("token"), tls=tls) as client:
        conn.send({"connected": True, "shared_memory": client.shared_memory})
        start = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await asyncio.sleep(max(0.0, start - time.time()))
        loop = Loop(client, random.Random(phase["seed"] * 1000 + index), phase["prompts"], start, phase["warmup_s"])
        end = start + phase["warmup_s"] + phase["duration_s"]
        while time.time() < end:
            await loop.one()
    return {"samples": loop.samples, "counts": loop.counts, "error_samples": loop.error_samples}


def main(index: int, conn: Connection) -> None:
    """The process body: phases until the parent sends None."""
    torch.set_num_threads(1)
    while (phase := conn.recv()) is not None:
        try:
            conn.send(asyncio.run(run_phase(phase, conn, index)))
        except Exception as exc:  # noqa: BLE001 - the parent reports a client that could not run as errors
            conn.send({"samples": [], "counts": {"errors": 1}, "error_samples": [f"client {index}: {type(exc).__name__}: {exc}"]})
