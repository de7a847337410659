"""One linear layer for the whole model, with pluggable weight storage.

Every projection of the decoder — fused q/k/v, output, fused gate/up, down and the LM head —
is a ``Linear``. What a layer *stores* and how it *multiplies* is its ``LinearMethod``:

- ``PlainMethod``: the checkpoint's matrix and ``F.linear`` (what every reference test runs);
- ``CPUPrepackMethod`` (``cpu_prepack.py``): oneDNN's prepacked layout, a CPU fast path;
- later chapters add more methods the same way (int8 / int4 weights, a tensor-parallel
  shard) — the model code does not change, only the method a layer is given.

Loading goes through the layer too. ``weight_loader`` copies one checkpoint tensor into the
layer's parameter: into the rows of one **shard** of a fused matrix (``"q"``, ``"k"``, ``"v"``
of ``qkv_proj``; ``"gate"``, ``"up"`` of ``gate_up_proj``), and — for tensor parallelism —
only this rank's **slice** of it (``tp_dim``/``tp_rank``/``tp_size``: rows for a
column-parallel layer, columns for a row-parallel one). Methods that change the storage run
after every tensor is loaded (``process_weights``), so the loader never sees packed formats.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(Protocol):
    """How a ``Linear`` holds its weight and computes ``x Wᵀ + b``."""

    name: str

    def process_weights(self, layer: Linear) -> None:
        """Turn the loaded plain weight into this method's storage (once, after loading)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x[..., in] → [..., out]``."""

    def held_tensors(self, layer: Linear) -> list[torch.Tensor]:
        """Every tensor this layer keeps for its matmul (for honest memory reports)."""


class PlainMethod:
    """The loaded matrix as it is, multiplied by ``F.linear``."""

    name = "plain"

    def process_weights(self, layer: Linear) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def held_tensors(self, layer: Linear) -> list[torch.Tensor]:
        return [t for t in (layer.weight, layer.bias) if t is not None]


PLAIN = PlainMethod()


class Linear(nn.Module):
    """``y = x Wᵀ + b`` whose storage and matmul belong to ``self.method``.

    ``shards``: the named row blocks of a fused matrix, in order (``{"q": 576, "k": 192, "v":
    192}``), sizes before any tensor-parallel split. ``tp_dim``: 0 splits the output rows
    across ``tp_size`` ranks (column parallel), 1 the input columns (row parallel); this layer
    then holds only rank ``tp_rank``'s part — an even split, or the ranges ``tp_slices`` names
    (per shard for column parallel, ``{None: columns}`` for row parallel), as attention needs
    when heads do not divide evenly or K/V heads are replicated.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        shards: dict[str, int] | None = None,
        tp_dim: int | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_slices: dict[str | None, range] | None = None,
    ):
        super().__init__()
        self.shards = shards or {None: out_features}  # full sizes, in row order
        if sum(self.shards.values()) != out_features:
            raise ValueError(f"shards {shards} add up to {sum(self.shards.values())}, not out_features={out_features}")
        if tp_dim not in (None, 0, 1) or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_dim={tp_dim!r} must be None, 0 or 1 and tp_rank={tp_rank} in [0, tp_size={tp_size})")
        if tp_slices is None:  # an even split: this rank's part of every shard (or of the input)
            split = dict(self.shards) if tp_dim == 0 else {None: in_features} if tp_dim == 1 else {}
            if any(size % tp_size for size in split.values()):
                raise ValueError(f"sizes {list(split.values())} do not split into tp_size={tp_size} parts")
            tp_slices = {k: range(tp_rank * n // tp_size, (tp_rank + 1) * n // tp_size) for k, n in split.items()}
        self.tp_dim, self.tp_rank, self.tp_size = tp_dim, tp_rank, tp_size
        self.tp_slices = tp_slices  # column parallel: rows kept of each shard; row parallel: input columns kept
        self.full_in = in_features
        self.in_features = len(tp_slices[None]) if tp_dim == 1 else in_features
        self.out_features = sum(len(tp_slices[k]) for k in self.shards) if tp_dim == 0 else out_features
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self.method: LinearMethod = PLAIN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def set_method(self, method: LinearMethod) -> None:
        """Switch storage and matmul (after loading): e.g. ``CPUPrepackMethod()``."""
        method.process_weights(self)
        self.method = method

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, method={self.method.name}"

    def weight_loader(self, param: str, loaded, shard: str | None = None) -> None:
        """Copy checkpoint tensor ``loaded`` (``param`` = "weight" or "bias") into this layer:
        the rows of ``shard`` if given, and only this rank's slice under tensor parallelism.
        ``loaded`` may be a lazy checkpoint slice (``.shape``, ``.narrow``, ``.load()``): then
        only this rank's part is ever read. Raises ``ValueError`` naming both shapes when
        ``loaded`` does not fit."""
        if shard not in self.shards:
            raise ValueError(f"has no shard {shard!r} to go into (this layer's shards: {list(self.shards)})")
        names = list(self.shards)
        local = (lambda n: len(self.tp_slices[n])) if self.tp_dim == 0 else self.shards.__getitem__
        start = sum(local(n) for n in names[: names.index(shard)])
        rows = self.shards[shard]
        expected = (rows,) if param == "bias" else (rows, self.full_in)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {expected}")
        target = self.weight if param == "weight" else self.bias
        if self.tp_dim == 0:  # column parallel: this rank's rows of the shard
            keep = self.tp_slices[shard]
            loaded = loaded.narrow(0, keep.start, len(keep))
        elif self.tp_dim == 1 and param == "weight":  # row parallel: this rank's input columns
            keep = self.tp_slices[None]
            loaded = loaded.narrow(1, keep.start, len(keep))
        elif self.tp_dim == 1 and self.tp_rank != 0:  # row parallel: partial sums are added, so add b once
            with torch.no_grad():
                target.zero_()
            return
        tensor = loaded if isinstance(loaded, torch.Tensor) else loaded.load()
        with torch.no_grad():
            target[start : start + tensor.shape[0]].copy_(tensor)
