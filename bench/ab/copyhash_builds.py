"""CPU per GB of one build of ``kvstore._copyhash``, to compare two builds of it (DESIGN §8, one
read of a shared page): build the other revision's extension elsewhere (``setup.py build_ext -b
DIR``) and run this on each .so in turn, alternating.

    python -m kvstore.bench.ab.copyhash_builds copy PATH.so          # copy_checksum, 64 pages of 2 MiB
    python -m kvstore.bench.ab.copyhash_builds scatter PATH.so 4096  # scatter_checksum in runs of 4096 B

Prints the best of 5 passes in process CPU seconds per GB."""

from __future__ import annotations

import importlib.util
import sys
import time
from typing import Any

import numpy as np

PAGE, PAGES = 2 << 20, 64


def load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("kvstore._copyhash", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy(native: Any) -> float:
    src = np.random.default_rng(0).integers(0, 256, (PAGES, PAGE), dtype=np.uint8)
    dst = np.empty_like(src)
    native.copy_checksum(dst[:1], src[:1])  # warm
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for i in range(PAGES):
            native.copy_checksum(dst[i : i + 1], src[i : i + 1])
        best = min(best, (time.process_time() - start) / (PAGES * PAGE / 1e9))
    return best


def scatter(native: Any, run: int) -> float:
    pages = PAGES // 2
    srcs = [np.random.default_rng(i).integers(0, 256, PAGE, dtype=np.uint8) for i in range(pages)]
    dst = np.zeros(2 * PAGE * pages, dtype=np.uint8)  # every other run of a page's place: a strided layout
    best = float("inf")
    for _ in range(5):
        sums = [native.Checksum() for _ in range(pages)]
        start = time.process_time()
        native.scatter_checksum(sums, dst, [2 * PAGE * i for i in range(pages)], [2 * run], [PAGE // run, run], srcs)
        best = min(best, (time.process_time() - start) / (pages * PAGE / 1e9))
    return best


def main() -> None:
    what, path = sys.argv[1], sys.argv[2]
    native = load(path)
    figure = copy(native) if what == "copy" else scatter(native, int(sys.argv[3]) if len(sys.argv) > 3 else 256)
    print(f"{what} {path}: best {figure:.4f} CPU s/GB")


if __name__ == "__main__":
    main()
