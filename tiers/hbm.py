"""The hbm tier needs CUDA. Until it is built, asking for it fails with a clear message,
and without a GPU it always does."""

from __future__ import annotations

from kvstore.errors import TierUnavailable


def require_cuda() -> None:
    try:
        import torch
    except ImportError as exc:
        raise TierUnavailable("--tiers hbm needs torch with CUDA; torch is not installed") from exc
    if not torch.cuda.is_available():
        raise TierUnavailable("--tiers hbm needs a CUDA device and none is visible; drop hbm from --tiers")
    raise TierUnavailable("--tiers hbm is not implemented yet in this version; use --tiers host,ssd")
