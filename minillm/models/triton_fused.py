"""Fused element-wise kernels for a decode step on the GPU: residual add + RMSNorm, and SiLU × up.

At batch 1 a GPU decode step is bound by kernel launches, not by bytes: SmolLM2-135M moves
~270 MB per token, 65 µs at the H200's 4 TB/s, yet one measured step took 2.8 ms. Each layer
ran, besides its matrix products, an add, an RMSNorm, another add, another RMSNorm, a SiLU and
a multiply — six launches over a few kilobytes each. Fused, as vLLM's ``fused_add_rms_norm``
and ``silu_and_mul`` do, they are two:

- ``add_rms_norm(delta, residual, weight, eps)``: ``residual + delta`` (the new residual stream)
  and its RMSNorm, one pass over the row;
- ``silu_and_mul(gate_up)``: ``silu(gate) * up`` from the fused gate/up projection's output.

One program per token row; the row is loaded once, the arithmetic is fp32, the results are
stored in the input's dtype. The engine uses them for the Triton backend on a GPU
(``LlamaForCausalLM.set_fused_kernels``); elsewhere PyTorch's own ops run, and the tests run
these kernels under Triton's interpreter against them. Under the interpreter the kernels store
fp32 and PyTorch casts (the interpreter rounds fp32 → bf16 wrongly), as ``triton_kernels.py``
explains.
"""

from __future__ import annotations

import torch

from minillm.triton_setup import INTERPRETED, tl, triton  # sets up (and checks) the interpreter first


@triton.jit
def _add_rms_norm_kernel(Delta, Residual, Weight, Normed, NewResidual, stride_d, stride_r, stride_n, stride_nr,
                         width, eps, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    valid = offs < width
    x = tl.load(Delta + row * stride_d + offs, mask=valid, other=0.0).to(tl.float32)
    x += tl.load(Residual + row * stride_r + offs, mask=valid, other=0.0).to(tl.float32)
    x = x.to(NewResidual.dtype.element_ty).to(tl.float32)  # the stream as it is stored: normalise that
    tl.store(NewResidual + row * stride_nr + offs, x.to(NewResidual.dtype.element_ty), mask=valid)
    mean_square = tl.sum(x * x, 0) / width
    w = tl.load(Weight + offs, mask=valid, other=0.0).to(tl.float32)
    y = x * (1.0 / tl.sqrt(mean_square + eps)) * w
    tl.store(Normed + row * stride_n + offs, y.to(Normed.dtype.element_ty), mask=valid)


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(rms_norm(residual + delta) * weight, residual + delta)`` for ``[..., hidden]`` rows."""
    if delta.shape != residual.shape or delta.shape[-1] != weight.shape[0]:
        raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)}, residual {tuple(residual.shape)}, "
                         f"weight {tuple(weight.shape)} do not match")  # fmt: skip
    width = delta.shape[-1]
    d, r = delta.reshape(-1, width), residual.reshape(-1, width)
    store = torch.float32 if INTERPRETED else delta.dtype
    normed = torch.empty(d.shape, dtype=store, device=d.device)
    new_residual = torch.empty(d.shape, dtype=store, device=d.device)
    if d.shape[0]:
        _add_rms_norm_kernel[(d.shape[0],)](
            d, r, weight, normed, new_residual, d.stride(0), r.stride(0), normed.stride(0), new_residual.stride(0),
            width, eps, BLOCK=triton.next_power_of_2(width),
        )  # fmt: skip
    shape = delta.shape
    return normed.to(delta.dtype).view(shape), new_residual.to(delta.dtype).view(shape)


@triton.jit
def _silu_and_mul_kernel(GateUp, Out, stride_g, stride_o, width, BLOCK: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    valid = offs < width
    gate = tl.load(GateUp + row * stride_g + offs, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_g + width + offs, mask=valid, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=valid)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up[..., 2·I]`` holds gate then up (the fused projection's
    layout). Returns ``[..., I]``."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dimension {gate_up.shape[-1]} must hold gate and up halves")
    width = gate_up.shape[-1] // 2
    g = gate_up.reshape(-1, 2 * width)
    if g.stride(-1) != 1:
        g = g.contiguous()
    out = torch.empty((g.shape[0], width), dtype=torch.float32 if INTERPRETED else gate_up.dtype, device=g.device)
    block = min(1024, triton.next_power_of_2(width))
    if g.shape[0]:
        _silu_and_mul_kernel[(g.shape[0], triton.cdiv(width, block))](g, out, g.stride(0), out.stride(0), width,
                                                                        BLOCK=block)  # fmt: skip
    return out.to(gate_up.dtype).view(*gate_up.shape[:-1], width)
