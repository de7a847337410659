"""A quantized KV cache: int8 or fp8 keys and values with one scale per token and head.

At long contexts and large batches the KV cache, not the weights, fills memory and dominates
what a decode step reads. Storing K and V in int8 halves their bytes (against bf16/fp16), so
the same pool holds about twice the tokens — twice the sequences at a given length.

Each token's key (and value) vector of each head gets its own symmetric scale,
``s = max|x| / 127``: scales are computed as the token is written (no calibration), and one
scale per (token, head) keeps an outlier head or token from costing the others precision.
The cost is a scale (4 bytes) per 64-128 values, and a quantize on write / dequantize on read.
The reference attention backends (``attention/paged.py``) do both in PyTorch with the two
functions below: they gather the 8-bit blocks and dequantize the copy before attending. The Triton kernels
(``attention/triton_kernels.py``) do the same arithmetic inside the kernels — quantizing as they
write a token, dequantizing **in registers** right after loading a tile — and that is the point:
the bytes read from memory, which bound a decode step, are halved (against bf16/fp16), while the
attention arithmetic stays fp32. The kernels reproduce ``quantize_kv`` bit for bit.

``fp8`` (e4m3: 4 exponent bits, 3 mantissa bits, largest value 448) spends its 8 bits
differently: relative precision is the same for small and large values (int8's is best near
the maximum), so it suits the long-tailed values of K and V. The scale maps each vector's
maximum to 448. PyTorch's CPU kernels cannot index-copy fp8 tensors, so the pool stores the
fp8 bit patterns as ``uint8`` and reinterprets them (``.view``) on the way in and out.
"""

from __future__ import annotations

import torch

import minillm.hooks as hooks

SCALE_DTYPE = torch.float32


FP8_MAX = 448.0  # the largest float8_e4m3fn value


@hooks.reference("quantize_kv")  # the paged write path calls it through the hook (chapter 07's exercise)
def quantize_kv(x: torch.Tensor, kind: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """``x[..., D]`` → ``(q [..., D], scale [...])`` with ``x ≈ value(q) * scale[..., None]``:
    ``q`` int8, or (``kind="fp8"``) e4m3 bit patterns as uint8."""
    top = FP8_MAX if kind == "fp8" else 127.0
    scale = x.detach().float().abs().amax(dim=-1).clamp(min=1e-8) / top
    scaled = x.float() / scale[..., None]
    if kind == "fp8":
        q = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        q = torch.round(scaled).clamp(-127, 127).to(torch.int8)
    return q, scale.to(SCALE_DTYPE)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    values = q.view(torch.float8_e4m3fn) if q.dtype == torch.uint8 else q
    return (values.to(torch.float32) * scale[..., None].float()).to(dtype)
