"""How a layer-wise load hands layers to the engine, chosen by the device of its KV.

* KV in host memory (CPU engines, tests): the worker thread copies, ``wait(layer)`` returns
  once the thread has copied the layer. Nothing else to do: ``HostLayers`` is a no-op.
* KV on a CUDA device: the worker issues each layer's copies on a side stream and records
  one event per layer there; ``wait(layer)`` then makes the engine's current stream wait on
  that event, so the engine never blocks the host on the copy (``CudaLayers``, CUDA ONLY:
  not run in CI; tests_gpu/ runs it on a GPU machine).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from kvstore.client.engine_kv import EngineKV


class LayerSignals(Protocol):
    def copying(self) -> contextlib.AbstractContextManager[Any]:
        """Context the worker copies (and reads back what landed) in."""
        ...

    def issued(self, layer: int) -> None:
        """The worker issued every copy of ``layer``."""
        ...

    def engine_waits(self, layer: int) -> None:
        """Called on the engine's thread once ``layer`` was issued: orders the engine's work
        after the layer's copies."""
        ...

    def drain(self) -> None:
        """Blocks the worker until every issued copy is done (before it gives its leases back)."""
        ...


def kv_device(into: EngineKV) -> torch.device:
    """The device the engine's KV lives on, read off the tensors it wraps (ContiguousKV
    ``kv``, PagedKV ``layers``, the HF adapter's ``keys``, the vLLM adapter's ``blocks``).
    Another kind counts as host memory: its copies then run synchronously on the worker's
    thread, which is correct on any device, only not overlapped on a side stream."""
    for name in ("kv", "layers", "keys", "blocks"):
        value = getattr(into, name, None)
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


class HostLayers:
    """KV in host memory: the worker's own copies are the whole story."""

    def copying(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def issued(self, layer: int) -> None:
        pass

    def engine_waits(self, layer: int) -> None:
        pass

    def drain(self) -> None:
        pass


class CudaLayers:
    """CUDA ONLY. A side stream for the load's copies and one event per layer."""

    def __init__(self, device: torch.device, num_layers: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.events = [torch.cuda.Event() for _ in range(num_layers)]

    def copying(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream)

    def issued(self, layer: int) -> None:
        self.events[layer].record(self.stream)

    def engine_waits(self, layer: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.events[layer])

    def drain(self) -> None:
        self.stream.synchronize()


def layer_signals(into: EngineKV, num_layers: int) -> LayerSignals:
    device = kv_device(into)
    return CudaLayers(device, num_layers) if device.type == "cuda" else HostLayers()
