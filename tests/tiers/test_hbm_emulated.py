"""What of the hbm tier CI can run besides the contract suite: the device check, the
config's validation, and the emulated pool as the CPU implementation of the device seam
makes it: shared memory another process maps through the descriptor it is handed."""

from __future__ import annotations

import pytest
import torch

from kvstore.config import HbmTierConfig
from kvstore.device_ops import CpuOps
from kvstore.errors import ConfigError, TierUnavailable
from kvstore.page import PageHeader
from kvstore.tiers.hbm import HbmTier, check_device
from kvstore.tiers.pools import OwnerPools


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


def test_an_emulated_pool_is_shared_memory_handed_out_by_descriptor() -> None:
    tier = HbmTier(HbmTierConfig(capacity_bytes=4 << 20, slab_bytes=1 << 20, device="cpu"))
    try:
        assert tier.pool.device.type == "cpu" and tier.pool.numel() == 4 << 20
        handout = tier.handout
        assert handout.device == "cpu" and handout.size_bytes == 4 << 20 and handout.fd >= 0 and not handout.handle
        payload = bytes(range(256)) * 16
        header = PageHeader(namespace_id=b"n" * 16, key=b"k" * 16, layout=None, payload_bytes=len(payload),  # type: ignore[arg-type]
                            checksum=0)  # write reads only payload_bytes
        slot = tier.reserve(len(payload))
        assert slot is not None
        tier.write([(slot, header, memoryview(payload))])
        tier.commit([(slot, header)])
        assert tier.stored_keys() == [header.key]
        opened = CpuOps().open_pool(handout, writable=False)  # as an engine maps it
        try:
            offset = tier.offset(slot)
            assert bytes(opened.tensor[offset : offset + len(payload)].numpy()) == payload
        finally:
            opened.close()
        assert not tier.fits(2 << 20) and tier.reserve(2 << 20) is None, "a page larger than a slab never fits"
    finally:
        tier.close()


def test_pools_of_tenants_are_separate_and_list_their_keys() -> None:
    pools = OwnerPools(HbmTierConfig(capacity_bytes=2 << 20, slab_bytes=1 << 20, device="cpu"), per_owner=True)
    try:
        assert pools.parts() == [], "a tenant's pool is made at its first use"
        a, b = pools.part("a"), pools.part("b")
        assert pools.part("a") is a and a.handout.token != b.handout.token and a.handout.fd != b.handout.fd
        header = PageHeader(namespace_id=b"n" * 16, key=b"k" * 16, layout=None, payload_bytes=4096,  # type: ignore[arg-type]
                            checksum=0)
        slot = b.reserve(4096)
        assert slot is not None and pools.at(slot) is b and b.offset(slot) == 0, "a slot names its pool"
        b.write([(slot, header, memoryview(bytes(4096)))])
        b.commit([(slot, header)])
        assert pools.part_of(header.key) is b and pools.part_of(b"x" * 16) is None, "a key names the pool that holds it"
        assert pools.stored_keys() == [header.key] and b.stored_keys() == [header.key] and a.stored_keys() == []
    finally:
        pools.close()
