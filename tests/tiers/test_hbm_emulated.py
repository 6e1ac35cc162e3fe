"""What of the hbm tier CI can run besides the contract suite: the device check, the
config's validation, and that the CUDA-only paths refuse an emulated pool clearly."""

from __future__ import annotations

import pytest
import torch

from kvstore.config import HbmTierConfig
from kvstore.errors import ConfigError, TierUnavailable
from kvstore.tiers.hbm import HbmTier, check_device
from kvstore.tiers.pinned import pinned


def test_the_device_check_refuses_cuda_where_there_is_none_and_names_the_switch() -> None:
    if torch.cuda.is_available():  # a GPU machine: the check passes and names the device
        assert check_device(HbmTierConfig(device="cuda")).type == "cuda"
        return
    with pytest.raises(TierUnavailable, match="CUDA") as err:
        check_device(HbmTierConfig(device="cuda"))
    assert "--hbm-device cpu" in str(err.value) and "tests only" in str(err.value)
    assert check_device(HbmTierConfig(device="cpu")) == torch.device("cpu")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "CUDA", ""])
def test_a_bad_device_names_the_flag(device: str) -> None:
    with pytest.raises(ConfigError, match="--hbm-device"):
        HbmTierConfig(device=device)


def test_an_emulated_pool_is_not_exported_and_its_arena_is_not_pinned() -> None:
    tier = HbmTier(HbmTierConfig(capacity_bytes=4 << 20, slab_bytes=1 << 20, device="cpu"))
    try:
        assert tier.pool.device.type == "cpu" and tier.pool.numel() == 4 << 20
        with pytest.raises(ValueError, match="only a CUDA pool"):
            tier.export()
        assert not tier.fits(2 << 20) and tier.reserve(2 << 20) is None, "a page larger than a slab never fits"
    finally:
        tier.close()
    host = object()
    assert pinned(host, None) is host and pinned(host, "cpu") is host  # type: ignore[arg-type]
