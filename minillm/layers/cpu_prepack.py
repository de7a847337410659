"""oneDNN weight prepacking: a CPU fast path for the linear layers.

A decode step multiplies one activation row by every weight matrix, so its speed is set by
how fast the GEMM kernel streams weights from memory. PyTorch's plain bf16 ``F.linear`` on
CPU reads them at well under half the machine's bandwidth. oneDNN (shipped inside PyTorch)
can reorder a weight *once* into the blocked layout its kernels consume; measured on our
2-core machine, bf16 GEMV then runs ~1.7× faster with bit-identical results. This is the same
idea as llama.cpp's weight repacking. The ops are PyTorch's private ``torch.ops.mkldnn``
entry points (the ones its compiler emits), so we check that they work and fall back to
plain ``F.linear`` when they do not.

The compiled decode step (``runtime/compiled_decode.py``) cannot use these opaque packed
tensors; with ``keep_plain_for_compile`` the method also keeps the plain matrix, as a
parameter, for the compiler to fold in and pack in its own layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minillm.layers.cpu_bf16_rows import traced_linear


def prepack_available(dtype: torch.dtype) -> bool:
    """True when this PyTorch build can prepack and run a linear layer of ``dtype`` on CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(8, 16).to(dtype)
        x = torch.randn(2, 16).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return torch.allclose(out.float(), F.linear(x, w).float(), atol=1e-2, rtol=1e-2)
    except (RuntimeError, AttributeError):
        return False


class CPUPrepackMethod:
    """``y = x Wᵀ + b`` with ``W`` held in oneDNN's prepacked layout (inference only).

    The plain weight is dropped after packing (the packed copy is what the matmul reads); a
    tied LM head keeps sharing nothing with the embedding, which still needs its plain rows.

    fp32 is the exception that proves the rule "measure it": for a single row, MKL's GEMV on
    a transposed, contiguous ``Wᵀ[in, out]`` streams fp32 weights ~20% faster than the packed
    kernel, while for a few rows the packed kernel is ~1.6× faster. So in fp32 we keep both
    layouts (twice the weight memory, which the memory report shows) and pick per call.
    """

    name = "cpu_prepack"

    def __init__(self, keep_plain_for_compile: bool = False):
        self.keep_plain_for_compile = keep_plain_for_compile

    def process_weights(self, layer) -> None:
        weight = layer.weight.detach()
        fp32 = weight.dtype == torch.float32
        rows_hint = 8 if fp32 else 1
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
        keep = self.keep_plain_for_compile  # single rows then run compiled, from the plain matrix
        layer.single_row_weight = weight.t().contiguous() if fp32 and not keep else None
        # A parameter (not a plain attribute), so a compiled graph with freezing folds it in as a constant.
        layer.plain_weight = torch.nn.Parameter(weight, requires_grad=False) if keep else None
        # Otherwise the plain matrix is no longer read; a tied head's weight stays alive through the embedding.
        layer.weight = None

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and layer.plain_weight is not None:
            return traced_linear(x, layer.plain_weight, layer.bias)  # folded in and packed by the compiler
        if layer.single_row_weight is not None and x.numel() == layer.in_features:
            row = x.reshape(1, layer.in_features)
            if layer.bias is None:
                y = torch.mm(row, layer.single_row_weight)
            else:
                y = torch.addmm(layer.bias, row, layer.single_row_weight)
            return y.view(*x.shape[:-1], layer.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")

    def held_tensors(self, layer) -> list[torch.Tensor]:
        kept = (layer.packed_weight, layer.single_row_weight, layer.plain_weight, layer.bias)
        return [t for t in kept if t is not None]


def release_plain_weights(model) -> None:
    """Drop the plain weight copies kept for the compiler (``keep_plain_for_compile``) once the
    compiled decode step holds its own, packed, copy — or will not be built."""
    for module in model.modules():
        method = getattr(module, "method", None)
        if getattr(method, "keep_plain_for_compile", False):
            module.plain_weight = None
