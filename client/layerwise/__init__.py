"""Layer-wise load and save: copies on their own worker, behind the engine's compute."""

from kvstore.client.layerwise.load import LayerLoad
from kvstore.client.layerwise.save import LayerSave
from kvstore.device_ops import DeviceOps  # a load's device seam (LayerLoad's ``ops``)

__all__ = ["DeviceOps", "LayerLoad", "LayerSave"]
