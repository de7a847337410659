"""One linear layer for the whole model, with pluggable weight storage.

Every projection of the decoder — fused q/k/v, output, fused gate/up, down and the LM head —
is a ``Linear``. What a layer *stores* and how it *multiplies* is its ``LinearMethod``:

- ``PlainMethod``: the checkpoint's matrix and ``F.linear`` (what every reference test runs);
- ``CPUPrepackMethod`` (``cpu_prepack.py``): oneDNN's prepacked layout, a CPU fast path;
- ``CPUUpcastMethod`` (``cpu_upcast.py``): half precision on a CPU oneDNN cannot pack it for —
  many rows multiplied in fp32;
- later chapters add more methods the same way (int8 / int4 weights, a tensor-parallel
  shard) — the model code does not change, only the method a layer is given.

Loading goes through the layer too. ``weight_loader`` copies one checkpoint tensor into the
layer's parameter: into the rows of one **shard** of a fused matrix (``"q"``, ``"k"``, ``"v"``
of ``qkv_proj``; ``"gate"``, ``"up"`` of ``gate_up_proj``), and — for tensor parallelism —
only this rank's **slice** of it (``tp_dim``/``tp_rank``/``tp_size``: rows for a
column-parallel layer, columns for a row-parallel one). Methods that change the storage run
after every tensor is loaded (``process_weights``), so the loader never sees packed formats —
except a checkpoint saved in a method's own format (``minillm quantize``): then the layer is
given that method *before* loading (``set_method(method, from_checkpoint=True)``) and the
method's ``weight_loader`` takes its saved tensors (``qweight``, ``scales``, ...). Either way
there is one road into a layer, its ``weight_loader``, and one place its method changes,
``set_method``.

A **row-parallel** layer's output is a partial sum (its rank multiplied only its input
columns), so the layer all-reduces it itself, over the ``parallel`` group it is built with:
the model code calls ``o_proj(x)`` the same whether it runs split or whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minillm.layers.cpu_bf16_rows import traced_linear

if TYPE_CHECKING:
    from minillm.layers.tensor_parallel import ParallelContext


class LinearMethod(Protocol):
    """How a ``Linear`` holds its weight and computes ``x Wᵀ + b``.

    Two optional abilities, looked up by name: ``embedding_rows(layer, ids)`` (the rows of the
    held matrix: a tied embedding reads them, ``embedding.py``) and ``weight_loader(layer,
    param, loaded)`` (tensors of a checkpoint saved in this method's format)."""

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
        if torch.compiler.is_compiling():
            return traced_linear(x, layer.weight, layer.bias)  # a few rows' own kernel, in some graphs
        return F.linear(x, layer.weight, layer.bias)

    def embedding_rows(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)

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
    when heads do not divide evenly or K/V heads are replicated. ``parallel``: the
    tensor-parallel group a row-parallel layer all-reduces its partial sums over (required for
    one; a ``ParallelContext`` or anything with its ``tp_rank``, ``tp_size``, ``all_reduce`` and
    ``all_reduce_max``).
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
        parallel: ParallelContext | None = None,
    ):
        super().__init__()
        self.shards = shards or {None: out_features}  # full sizes, in row order
        if sum(self.shards.values()) != out_features:
            raise ValueError(f"shards {shards} add up to {sum(self.shards.values())}, not out_features={out_features}")
        if tp_dim not in (None, 0, 1) or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_dim={tp_dim!r} must be None, 0 or 1 and tp_rank={tp_rank} in [0, tp_size={tp_size})")
        self.reduces = tp_dim == 1 and tp_size > 1  # row parallel: the output is this rank's partial sum
        if self.reduces and (parallel is None or (parallel.tp_rank, parallel.tp_size) != (tp_rank, tp_size)):
            raise ValueError(
                f"a row-parallel layer (tp_rank={tp_rank}, tp_size={tp_size}) needs parallel= the tensor-parallel "
                f"group of that rank to add its partial sums over (got {parallel!r})"
            )
        if tp_slices is None:  # an even split: this rank's part of every shard (or of the input)
            split = dict(self.shards) if tp_dim == 0 else {None: in_features} if tp_dim == 1 else {}
            if any(size % tp_size for size in split.values()):
                raise ValueError(f"sizes {list(split.values())} do not split into tp_size={tp_size} parts")
            tp_slices = {k: range(tp_rank * n // tp_size, (tp_rank + 1) * n // tp_size) for k, n in split.items()}
        self.tp_dim, self.tp_rank, self.tp_size = tp_dim, tp_rank, tp_size
        self.tp_slices = tp_slices  # column parallel: rows kept of each shard; row parallel: input columns kept
        self.parallel = parallel
        self.full_in = in_features
        self.in_features = len(tp_slices[None]) if tp_dim == 1 else in_features
        self.out_features = sum(len(tp_slices[k]) for k in self.shards) if tp_dim == 0 else out_features
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self.method: LinearMethod = PLAIN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return self.parallel.all_reduce(y) if self.reduces else y

    def set_method(self, method: LinearMethod, from_checkpoint: bool = False) -> None:
        """Switch storage and matmul — the one place a layer's method changes. By default after
        loading: the method converts the loaded plain weight now (``process_weights``), e.g.
        ``CPUPrepackMethod()`` or ``Int8Method()``. ``from_checkpoint=True``, before loading a
        checkpoint saved in the method's own format: nothing is converted, and the method's
        ``weight_loader`` takes the saved tensors as ``weight_loader`` hands them on."""
        if not from_checkpoint:
            method.process_weights(self)
        elif getattr(method, "weight_loader", None) is None:
            raise ValueError(f"method {method.name!r} has no checkpoint format to load (no weight_loader)")
        self.method = method

    @property
    def gives_rows(self) -> bool:
        """Can this layer's storage give rows of its matrix (``embedding_rows``)?"""
        return getattr(self.method, "embedding_rows", None) is not None

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the matrix this layer holds, in its dtype: a tied embedding's lookup,
        read through whatever storage the method keeps (``embedding.py``)."""
        if not self.gives_rows:
            raise ValueError(f"{self.method.name!r} storage cannot give rows of its matrix")
        return self.method.embedding_rows(self, ids)

    def full_row_absmax(self) -> torch.Tensor | None:
        """Each output row's largest ``|w|`` over the *whole* row (fp32), when this layer holds
        only some of each row's columns (row parallel: every rank's slice, all-reduced with max);
        None when it holds whole rows. A per-row quantization scale taken from it rounds the
        slice exactly as the one-process layer rounds the same columns."""
        if not self.reduces:
            return None
        return self.parallel.all_reduce_max(self.weight.detach().float().abs().amax(dim=1))

    def held_by_name(self) -> dict[str, torch.Tensor]:
        """Every tensor the method holds, by the attribute it is held under (parameters and
        plain attributes): what offloading moves. A held tensor under no attribute of its own
        (inside a tensor subclass, say) is missing here — offloading refuses such a layer."""
        held = self.method.held_tensors(self)
        attrs = {**vars(self), **self._parameters}
        return {name: t for name, t in attrs.items() if isinstance(t, torch.Tensor) and any(t is h for h in held)}

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, method={self.method.name}"

    def weight_loader(self, param: str, loaded, shard: str | None = None) -> None:
        """Copy checkpoint tensor ``loaded`` (``param`` = "weight" or "bias") into this layer:
        the rows of ``shard`` if given, and only this rank's slice under tensor parallelism. A
        fused layer given no shard takes the whole fused tensor, shard by shard. Any other
        ``param`` is a tensor of a checkpoint saved in the method's format: the method takes it.
        ``loaded`` may be a lazy checkpoint slice (``.shape``, ``.narrow``, ``.load()``): then
        only this rank's part is ever read. Raises ``ValueError`` naming both shapes when
        ``loaded`` does not fit."""
        if param not in ("weight", "bias"):
            loader = getattr(self.method, "weight_loader", None)
            if loader is None:
                raise ValueError(f"is not a tensor of a {self.method.name!r} layer (weight or bias)")
            loader(self, param, loaded)
            return
        if shard is None and None not in self.shards:  # a fused tensor saved whole
            self._load_fused(param, loaded)
            return
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

    def _load_fused(self, param: str, loaded) -> None:
        """The whole fused tensor (every shard's full rows, in order) into its shards."""
        total = sum(self.shards.values())
        if loaded.shape[0] != total:
            raise ValueError(f"has {loaded.shape[0]} rows, expected the {total} of shards {dict(self.shards)}")
        start = 0
        for name, rows in self.shards.items():
            self.weight_loader(param, loaded.narrow(0, start, rows), name)
            start += rows
