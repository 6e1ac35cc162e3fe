"""Layer-wise load and save: copies on their own worker, behind the engine's compute."""

from kvstore.client.layerwise.load import LayerLoad
from kvstore.client.layerwise.save import LayerSave

__all__ = ["LayerLoad", "LayerSave"]
