"""SGLang's real HiCache storage interface, loaded from the sglang==0.5.23 wheel that
``make install-engines`` downloads (SGLang does not run on CPU, and ``sglang/__init__``
pulls a CUDA stack): the two files the interface needs are extracted beside empty
package ``__init__`` files and put first on ``sys.path``.

Also a host KV pool with SGLang's page methods (``get_data_page``,
``set_from_flat_data_page``, ``get_dummy_flat_data_page``) for its MHA layouts; SGLang's
own pool class needs CUDA kernels to import."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import torch

WHEELS = Path(sys.prefix) / "engine-wheels"
FILES = ("sglang/srt/mem_cache/hicache_storage.py", "sglang/srt/environ.py")


def load_sglang_interface(root: Path) -> None:
    """Makes ``sglang.srt.mem_cache.hicache_storage`` importable from the wheel's own file."""
    wheels = sorted(WHEELS.glob("sglang-0.5.23-*.whl"))
    assert wheels, f"no sglang wheel in {WHEELS}: run `make install-engines`"
    with zipfile.ZipFile(wheels[0]) as wheel:
        for name in FILES:
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(wheel.read(name))
    for package in ("sglang", "sglang/srt", "sglang/srt/mem_cache"):
        (root / package / "__init__.py").touch()
    sys.path.insert(0, str(root))


class HostPool:
    """An MHA host pool: ``kv_buffer`` shaped as SGLang lays out ``layout``; pages are
    addressed by the token index of their first token."""

    def __init__(self, layout: str, layers: int = 3, heads: int = 2, head_dim: int = 16, page_size: int = 8,
                 num_pages: int = 16, dtype: torch.dtype = torch.float16) -> None:
        self.layout, self.layer_num, self.head_num, self.head_dim = layout, layers, heads, head_dim
        self.page_size, self.dtype, self.size = page_size, dtype, page_size * num_pages
        shapes = {
            "layer_first": (2, layers, self.size, heads, head_dim),
            "page_first": (2, self.size, layers, heads, head_dim),
            "page_first_direct": (2, num_pages, layers, page_size, heads, head_dim),
        }
        self.kv_buffer = torch.zeros(shapes[layout], dtype=dtype)

    def _page(self, index: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index : index + self.page_size]
        if self.layout == "page_first":
            return self.kv_buffer[:, index : index + self.page_size]
        return self.kv_buffer[:, index // self.page_size : index // self.page_size + 1]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * self.layer_num * self.page_size * self.head_num * self.head_dim, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(index)
        page.copy_(data_page.reshape(page.shape))

    def canonical(self, index: int) -> torch.Tensor:
        """Page ``index`` as ``[layers, K|V, tokens, heads, dim]``, computed independently
        of the backend's conversion (element by element from the buffer)."""
        out = torch.empty(self.layer_num, 2, self.page_size, self.head_num, self.head_dim, dtype=self.dtype)
        for layer in range(self.layer_num):
            for kv in range(2):
                for t in range(self.page_size):
                    if self.layout == "layer_first":
                        out[layer, kv, t] = self.kv_buffer[kv, layer, index + t]
                    elif self.layout == "page_first":
                        out[layer, kv, t] = self.kv_buffer[kv, index + t, layer]
                    else:
                        out[layer, kv, t] = self.kv_buffer[kv, index // self.page_size, layer, t]
        return out

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=g).to(self.dtype))
