"""The host arena page-locked for DMA while a CUDA hbm pool copies in and out of it.

``cudaHostRegister`` is per process: this pins the server's own mapping (promotions into
hbm, demotions out of it); an engine process pins its mapping itself (client/arena.py).
"""

from __future__ import annotations

from kvstore.tiers.base import LandingTier, TierWrapper


def pinned(host: LandingTier, hbm_device: str | None) -> LandingTier:
    """``host`` itself unless an hbm pool on a CUDA device copies through it."""
    if hbm_device is None or not hbm_device.startswith("cuda"):
        return host
    return PinnedArena(host)  # type: ignore[return-value]  # a LandingTier by delegation


class PinnedArena(TierWrapper):
    """CUDA ONLY (not run in CI): pins the arena when opened, unpins it before it is unmapped."""

    def __init__(self, inner: LandingTier) -> None:
        from kvstore import cuda_host

        super().__init__(inner)
        self._address = cuda_host.host_address(inner.view(0, 1))
        self._pinned = cuda_host.pin_host(self._address, inner.arena.size_bytes)

    def close(self) -> None:
        if self._pinned:
            from kvstore import cuda_host

            cuda_host.unpin_host(self._address)
            self._pinned = False
        self.inner.close()
