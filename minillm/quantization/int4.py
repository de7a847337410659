"""int4 weight-only quantization: group-wise, asymmetric, two values per byte.

Four bits give only 16 levels, so one scale per row is too coarse: each row is cut into groups
of ``group_size`` consecutive input weights, and each group gets its own ``scale`` and
``minimum``: ``q = round((w - min) / scale)`` in ``[0, 15]`` with ``scale = (max - min) / 15``.
The zero point (``min``) is what makes it *asymmetric*: a group whose weights are mostly
positive uses all 16 levels instead of half. Smaller groups are more accurate and cost more
scale bytes (at 32: 2 bf16 numbers per 32 weights = 1 extra bit per weight).

Storage (what a checkpoint holds): ``pack_int4`` puts two 4-bit values in each byte, low
nibble first. On CPU, PyTorch's ``_weight_int4pack_mm_for_cpu`` consumes its own tiled layout
(made once by ``_convert_weight_to_int4pack_for_cpu``) and a ``[groups, out, 2]`` table of
``(scale, zero)`` with ``w = (q - 8) · scale + zero`` — so our zero is ``min + 8 · scale``.
That kernel is for bf16 activations (a bf16 engine on CPU). On CUDA the layer keeps the packed
``[out, in/2]`` bytes with fp32 ``[out, groups]`` scales and minima, and calls our Triton kernel
(``triton_matmul.int4_matmul``: reads half a byte per weight and dequantizes in registers).
Elsewhere (fp32 or fp16 on CPU) the layer dequantizes and calls ``F.linear`` (the numerical
reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import minillm.hooks as hooks
from minillm.config import INT4_GROUP_SIZES  # what the CPU kernel accepts
from minillm.quantization.int8 import use_triton
from minillm.quantization.saved import LoadsSavedTensors


@hooks.reference("quantize_int4")  # Int4Method.process_weights calls it through the hook (chapter 07)
def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight[out, in]`` → ``(q uint8 [out, in] in 0..15, scale fp32 [out, groups], minimum fp32 [out, groups])``
    with ``weight ≈ q * scale + minimum`` per group.

    float32 arithmetic whatever the weight's dtype: in bf16, ``(max - min) / 15`` and
    ``(w - min) / scale`` would themselves round and put weights on the wrong level. The floor on
    the scale only keeps a constant group (max = min) from dividing 0 by 0: its weights all get
    level 0, and ``0 * scale + min`` gives them back exactly; it is far below any real group's
    step, so it changes no other scale."""
    out, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"int4 group_size={group_size} does not divide the layer's {cols} input features")
    w = weight.detach().float().reshape(out, cols // group_size, group_size)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15.0).clamp(min=1e-12)
    q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(out, cols), scale, low


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    out, cols = q.shape
    groups = scale.shape[1]
    w = q.float().reshape(out, groups, cols // groups) * scale[..., None] + minimum[..., None]
    return w.reshape(out, cols).to(dtype)


@hooks.reference("pack_int4")  # the checkpoint writer calls it through the hook (chapter 07)
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q uint8 [out, in]`` (values 0..15, ``in`` even) → ``uint8 [out, in/2]``, low nibble first."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {q.shape[-1]}")
    if int(q.max()) > 15:
        raise ValueError("int4 values must be in 0..15")
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


@hooks.reference("unpack_int4")  # the checkpoint reader calls it through the hook (chapter 07)
def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


class Int4Method(LoadsSavedTensors):
    """A linear layer stored as group-wise int4 (the CPU kernel's tiled layout on CPU).

    ``unpack``: how saved bytes become values 0..15 when the layer loads a checkpoint (the
    checkpoint reader passes its own, so the saved format is decoded in one place)."""

    name = "int4"

    def __init__(self, group_size: int = 128, unpack=None):
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group_size={group_size!r} must be one of {INT4_GROUP_SIZES}")
        self.group_size = group_size
        self.unpack = unpack  # None: this module's unpack_int4

    def validate(self, layer, name: str) -> None:
        """Groups run along the input, so a row-parallel slice must start and end on a group
        boundary: then every rank's groups are the one-process layer's groups, scale for scale."""
        out, cols, g = layer.out_features, layer.in_features, self.group_size
        keep = layer.tp_slices[None] if layer.tp_dim == 1 and layer.tp_size > 1 else None
        if keep is not None and (keep.start % g or len(keep) % g):
            raise ValueError(
                f"{name}: int4 group_size={g} does not cut tensor-parallel rank {layer.tp_rank}'s input slice "
                f"{keep.start}:{keep.stop} (of {layer.full_in}) into whole groups — a row-parallel layer's groups run "
                f"along its input slice; choose a quantization_group_size that divides it"
            )
        if cols % g:
            raise ValueError(f"{name}: int4 group_size={g} does not divide its {cols} input features")
        if out % 16:
            raise ValueError(f"{name}: int4 needs output features divisible by 16 (the CPU kernel's tile), got {out}")

    def process_weights(self, layer) -> None:
        self.validate(layer, repr(layer))
        # Through the hook: chapter 07 plugs a learner's group quantizer in here. A row-parallel
        # shard needs no special call: validate() made its slice start and end on group boundaries.
        q, scale, low = hooks.quantize_int4(layer.weight, self.group_size)
        self.install(layer, q, scale, low)

    def install(self, layer, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> None:
        """Hold ``q`` (values 0..15, unpacked) with its group scales and minima — quantized now,
        or loaded from a quantized checkpoint."""
        self.validate(layer, repr(layer))
        weight = layer.weight
        device, layer.dtype = weight.device, weight.dtype
        q, scale, low = q.to(device), scale.float().to(device), low.float().to(device)
        layer.int4 = pack_int4(q)  # the storage format: two values per byte
        layer.int4_scale, layer.int4_min = scale, low
        layer.cpu_int4 = None
        # PyTorch's CPU kernel for bf16 activations; fp32 ones dequantize and multiply instead. On
        # an AMD EPYC without AVX-512, 2 threads, a 1536x576 layer: one fp32 row 1.14 ms through
        # the kernel, 0.65 ms dequantized; 512 rows (a prompt) 523 ms against 11 ms. At one thread
        # the kernel won below 8 rows (1.9 against 5.5 ms for one) and lost 24-63x from 16 rows
        # (benchmarks/bench_int4_cpu.py). bf16 rows stay on the kernel: 4-14x faster there.
        if device.type == "cpu" and weight.dtype == torch.bfloat16:
            zero = low + 8 * scale  # the kernel computes (q - 8) * scale + zero
            layer.cpu_int4 = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
            layer.cpu_table = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
            layer.int4 = None  # the kernel's tiled copy is what the matmul reads
        layer.weight = None

    def saved_shapes(self, layer) -> dict[str, tuple[int, ...]]:
        out, cols = layer.out_features, layer.in_features
        groups = (out, cols // self.group_size)
        return {"int4": (out, cols // 2), "int4_scale": groups, "int4_min": groups}

    def install_saved(self, layer, saved: dict[str, torch.Tensor]) -> None:
        self.install(layer, self.saved_values(saved), saved["int4_scale"], saved["int4_min"])

    def saved_values(self, saved: dict[str, torch.Tensor]) -> torch.Tensor:
        """The saved ``int4`` bytes as values 0..15."""
        return (self.unpack or unpack_int4)(saved["int4"])

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x) and layer.int4 is not None:
            return self.apply_triton(layer, x)
        rows = x.reshape(-1, layer.in_features)
        if layer.cpu_int4 is not None and x.dtype == torch.bfloat16:
            y = torch._weight_int4pack_mm_for_cpu(rows, layer.cpu_int4, self.group_size, layer.cpu_table)
        else:
            q = unpack_int4(layer.int4)
            y = F.linear(rows, dequantize_int4(q, layer.int4_scale, layer.int4_min, x.dtype))
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def apply_triton(self, layer, x: torch.Tensor) -> torch.Tensor:
        """The CUDA path: the Triton kernel on the packed bytes, scales and minima as held.
        ``apply`` takes it only on CUDA; tests call it directly on CPU (under Triton's
        interpreter) on a layer that holds the packed form."""
        # deferred: triton: imported only when a Triton matmul runs
        from minillm.quantization.triton_matmul import int4_matmul

        rows = x.reshape(-1, layer.in_features)
        y = int4_matmul(rows, layer.int4, layer.int4_scale, layer.int4_min, self.group_size)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def held_tensors(self, layer) -> list[torch.Tensor]:
        kept = (
            (layer.cpu_int4, layer.cpu_table)
            if layer.cpu_int4 is not None
            else (layer.int4, layer.int4_scale, layer.int4_min)
        )
        return [t for t in (*kept, layer.bias) if t is not None]
