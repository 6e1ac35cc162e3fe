"""A stand-in for a client's arena mapping whose bytes another process changes after each read:
what the one-read tests of copies out of shared memory (test_shm_read_once.py,
adapters/test_leased_copy.py) hand to the code under test instead of a real mapping."""

from __future__ import annotations

import numpy as np
import torch


class ChangingArena:
    """``pages`` ([n, page_bytes] uint8) laid out one after another; every access after the
    first (``array`` or ``slot``) flips the first byte of each page (``reads`` counts them)."""

    def __init__(self, pages: np.ndarray) -> None:
        self._page_bytes = pages.shape[1]
        self._data = pages.reshape(-1).copy()
        self.reads = 0

    def _read(self) -> np.ndarray:
        self.reads += 1
        if self.reads > 1:
            self._data[:: self._page_bytes] ^= 0xFF
        return self._data

    @property
    def array(self) -> np.ndarray:
        return self._read()

    def slot(self, offset: int, nbytes: int) -> torch.Tensor:
        return torch.from_numpy(self._read()[offset : offset + nbytes])
