"""How a layer-wise load hands layers to the engine, chosen by the device of its KV.

More: client/layerwise/README.md (### device.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from kvstore.client.engine_kv import EngineKV
from kvstore.device_ops import DeviceOps


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


class StreamLayers:
    """KV on a device: a side stream for the load's copies and one event per layer."""

    def __init__(self, ops: DeviceOps, num_layers: int) -> None:
        self.ops = ops
        self.stream = ops.stream()
        self.events = [ops.event() for _ in range(num_layers)]

    def copying(self) -> contextlib.AbstractContextManager[Any]:
        return self.ops.on(self.stream)

    def issued(self, layer: int) -> None:
        self.ops.record(self.events[layer], self.stream)

    def engine_waits(self, layer: int) -> None:
        self.ops.wait(self.events[layer])

    def drain(self) -> None:
        self.ops.synchronize(self.stream)


def layer_signals(ops: DeviceOps | None, num_layers: int) -> LayerSignals:
    """``ops``: the device seam of the engine's KV (None: host memory)."""
    return HostLayers() if ops is None else StreamLayers(ops, num_layers)
