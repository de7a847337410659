"""The checkpoint side of a quantized method: its saved tensors go in through the layer's loader.

A quantized checkpoint (``checkpoint.py``) stores each linear layer in its method's own format
(``qweight`` and ``scales`` for int8, packed ``int4`` with its group tables for int4, ...). To
load one, the layer is given that method first (``Linear.set_method(method,
from_checkpoint=True)``); then each saved tensor arrives like any other checkpoint tensor, through
``Linear.weight_loader``, which hands it to the method's ``weight_loader`` here. The method checks
its name and shape, keeps it until the layer's last one has arrived, and then installs them all
at once — the same ``install`` the method runs after quantizing in memory, so a loaded layer holds
exactly what a freshly quantized one holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class LoadsSavedTensors(ABC):
    """Base of a method whose storage can be loaded as saved. A subclass names its tensors and
    their shapes for a layer (``saved_shapes``) and installs them (``install_saved``)."""

    name: str

    @abstractmethod
    def saved_shapes(self, layer) -> dict[str, tuple[int, ...]]:
        """Saved tensor name → its shape, for ``layer``."""

    @abstractmethod
    def install_saved(self, layer, saved: dict[str, torch.Tensor]) -> None:
        """Hold ``saved`` (every one of ``saved_shapes``) as this method's storage of ``layer``."""

    def weight_loader(self, layer, param: str, loaded) -> None:
        """Take saved tensor ``param`` (a tensor, or a lazy checkpoint slice read here); once
        every one of ``saved_shapes`` has arrived, install them. ``ValueError`` names a tensor
        this method does not save or a shape that does not fit."""
        shapes = self.saved_shapes(layer)
        if param not in shapes:
            raise ValueError(f"is not a tensor of a {self.name} layer (those are {sorted(shapes)})")
        if tuple(loaded.shape) != shapes[param]:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {shapes[param]}")
        arrived = getattr(layer, "saved_arrived", None) or {}
        arrived[param] = loaded if isinstance(loaded, torch.Tensor) else loaded.load()
        layer.saved_arrived = arrived
        if arrived.keys() == shapes.keys():
            layer.saved_arrived = None
            self.install_saved(layer, arrived)
